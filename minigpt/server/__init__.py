"""The OpenAI-compatible HTTP server (`python -m minigpt.serve`; the `server` extra: FastAPI, uvicorn, jinja2).

    protocol.py     request bodies (pydantic), their sampling fields marked once (Sampled), and their EnginePlan;
                    refusals name the body's fields (FieldNames)
    responses.py    answer shapes: headers, choices, usage, OpenAI's legacy logprobs
    submit.py       an EnginePlan submitted to the engine; its refusals and failures as OpenAI errors
    completions.py  /v1/completions and /v1/models
    chat.py         /v1/chat/completions over the completions mapping
    chat_template.py  Jinja chat templates rendered as transformers' apply_chat_template renders them
    tokenization.py vLLM's /tokenize, /detokenize and /tokenizer_info
    streams.py      server-sent events, merged deltas, client disconnects
    errors.py       OpenAI-style error bodies and the handlers that produce them
    middleware.py   API key, request body size and time limits
    connections.py  uvicorn's config: header deadline, connection limit
    limits.py       the defaults of what one client may send or hold
    shutdown.py     graceful shutdown: drain, then abort the rest
    app.py          the FastAPI app: routes, middleware, handlers
"""
