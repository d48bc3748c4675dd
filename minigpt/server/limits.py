"""The serve flags' defaults of what one client may send or hold (readable without the server extra)."""

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a few hundred full-context prompts as token ids
DEFAULT_READ_TIMEOUT = 30.0  # seconds for a request's headers, and again for its body
DEFAULT_LIMIT_CONCURRENCY = 512  # connections and requests in flight past which a new request gets 503
