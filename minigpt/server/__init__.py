"""The OpenAI-compatible HTTP front of minigpt (`python -m minigpt.serve`).

    protocol.py   the /v1/completions request schema, its mapping to SamplingParams, response shapes
    errors.py     OpenAI-style error bodies and the exception handlers that produce them
    tokenization.py vLLM's /tokenize, /detokenize and /tokenizer_info (lm-eval's remote tokenizer)
    middleware.py ASGI middleware: API key, request body size limit
    app.py        the FastAPI app: routes, streaming, cancellation on disconnect

Needs the optional `server` extra (FastAPI + uvicorn): pip install "minigpt[server]".
"""
