"""An `EnginePlan` submitted to the engine, its refusals and failures as OpenAI errors (HTTP and batch jobs)."""

from __future__ import annotations

from minigpt.async_llm.async_engine import AsyncLLM, QueueFullError
from minigpt.async_llm.request_handle import RequestHandle
from minigpt.common.errors import ParamError
from minigpt.server.errors import APIError, invalid
from minigpt.server.protocol import EnginePlan


def submit_plan(llm: AsyncLLM, plan: EnginePlan) -> list[RequestHandle]:
    """One engine request per prompt, all or none; may compile a grammar: run it off the event loop."""
    prompts, params = plan.prompts, plan.params
    handles: list[RequestHandle] = []
    if len(prompts) > llm.config.max_waiting:  # a 503 would tell the client to retry in vain
        raise invalid(f"a request of {len(prompts)} prompts can never fit the server's queue of "
                      f"{llm.config.max_waiting} (max_waiting)", plan.names.prompt)
    try:
        for prompt in prompts:
            handles.append(llm.submit(prompt, params))
    except QueueFullError as err:
        raise APIError(503, f"the server is overloaded: {err}", "server_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except (ValueError, TypeError) as err:  # e.g. a logit_bias id past the vocab, a regex the grammar refuses
        where = f"prompt {len(handles)}: " if len(prompts) > 1 else ""
        if isinstance(err, ParamError):
            raise plan.names.refusal(err, where) from None
        raise invalid(where + str(err), plan.names.prompt) from None
    except ImportError as err:  # structured outputs without their extra
        raise APIError(400, str(err), param=plan.names.structured) from None
    except RuntimeError as err:  # the engine is closed
        raise APIError(503, f"the engine is not running: {err}", "server_error") from None
    finally:
        if len(handles) < len(prompts):
            for handle in handles:
                handle.cancel()
    return handles


def failure(handles: list[RequestHandle]) -> APIError | None:
    """The 500 for requests the engine failed (finish_reason "error"); None when none failed."""
    error = next((h.error for h in handles if h.error), None)
    return None if error is None else APIError(500, f"generation failed: {error}", "server_error")
