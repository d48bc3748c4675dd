"""The OpenAI-compatible HTTP front of minigpt (`python -m minigpt.serve`).

    protocol.py   the /v1/completions request schema, its plan of engine requests (EnginePlan), response shapes
    submit.py     an EnginePlan submitted to the engine, its refusals and failures as OpenAI errors
    chat.py       /v1/chat/completions: its request schema, plan, chunks and logprobs, over the completions mapping
    chat_template.py  Jinja chat templates rendered as transformers' apply_chat_template renders them
    streams.py    server-sent events, merged deltas, client disconnects
    shutdown.py   graceful shutdown: drain the requests in flight, then abort the rest
    errors.py     OpenAI-style error bodies and the exception handlers that produce them
    tokenization.py vLLM's /tokenize, /detokenize and /tokenizer_info (lm-eval's remote tokenizer)
    middleware.py ASGI middleware: API key, request body size and time limits
    connections.py uvicorn's config: a deadline for request headers, a limit on connections and requests
    limits.py     the defaults of what one client may send or hold (body size, read timeout, concurrency)
    app.py        the FastAPI app: routes, streaming, cancellation on disconnect

Batch jobs (minigpt/batch_jobs/) answer bodies with the same plan, submit and response builders.
Needs the optional `server` extra (FastAPI, uvicorn, jinja2): pip install "minigpt[server]".
"""
