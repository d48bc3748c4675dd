"""The async engine (AsyncLLM) serving many callers at once: one engine thread, handles to its requests, counters.

    async_engine.py    AsyncLLM: submit from any thread or asyncio task; the engine thread steps
    request_handle.py  RequestHandle (deltas, result, cancel) and StreamDelta
    metrics.py         engine-wide counters for /metrics
"""
