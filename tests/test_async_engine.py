"""AsyncLLM: threads and asyncio tasks share one engine thread, and each gets exactly what
`LLM.generate` gives its request alone (greedy, fp32). Streams join to the final text;
cancellation, a full queue, close() and a failing step end only what they should and leave the
KV pool empty. Tests that need the engine mid-step hold it there with a `Gate`, never a sleep."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter

import pytest

from minigpt import LLM, AsyncLLM, BeamSearchParams, QueueFullError, SamplingParams, StreamDelta
from minigpt.engine.request import RequestOutput

TEXTS = ["Hello, world", "日本語のテキスト 🎉", "🙂🙃 emoji 🚀", "中文提示：你好", "The quick brown fox", "x"]


def _cases(count: int = 32, seed: int = 0) -> list[tuple[str | list[int], SamplingParams]]:
    """Varied prompts (text, emoji, CJK, token ids of 1..60 tokens) and lengths, all within n_positions=128."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        prompt = TEXTS[i % len(TEXTS)] if i % 2 else [rng.randrange(50257) for _ in range(rng.randint(1, 60))]
        logprobs = 2 if i % 3 == 0 else None
        cases.append((prompt, SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=i % 5 != 0, logprobs=logprobs)))
    return cases


CASES = _cases()
LONG = SamplingParams(max_tokens=100, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(tiny_checkpoint) -> list[RequestOutput]:
    """Each case generated on its own by the synchronous engine."""
    with LLM(str(tiny_checkpoint)) as llm:
        return [llm.generate([prompt], params)[0] for prompt, params in CASES]


@pytest.fixture
def async_llm(tiny_checkpoint):
    def make(**engine_args) -> AsyncLLM:
        llm = AsyncLLM(str(tiny_checkpoint), **engine_args)
        made.append(llm)
        return llm

    made: list[AsyncLLM] = []
    yield make
    for llm in made:
        llm.close()


class Gate:
    """Holds the engine thread inside its `pause_at`-th model call until released, so a test acts
    while the engine is provably mid-step. Leaving the `with` block releases it."""

    def __init__(self, llm: AsyncLLM, monkeypatch, pause_at: int) -> None:
        self.entered, self._open = threading.Event(), threading.Event()
        self._calls = 0
        forward = llm.engine.runner.run

        def gated(*args, **kwargs):
            self._calls += 1
            if self._calls == pause_at:
                self.entered.set()
                self._open.wait()
            return forward(*args, **kwargs)

        monkeypatch.setattr(llm.engine.runner, "run", gated)

    def release(self) -> None:
        self._open.set()

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _check_stream(deltas: list[StreamDelta], out: RequestOutput) -> None:
    """Each completion's deltas join to its text, tokens and logprobs; only its last one is final."""
    for index, completion in enumerate(out.outputs):
        mine = [d for d in deltas if d.index == index]
        assert "".join(d.text for d in mine) == completion.text
        assert [t for d in mine for t in d.token_ids] == completion.token_ids
        if completion.logprobs is None:
            assert all(d.logprobs is None for d in mine)
        else:
            assert [lp for d in mine for lp in d.logprobs] == completion.logprobs
            assert all(len(d.logprobs) == len(d.token_ids) for d in mine)
        assert [d.finished for d in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == completion.finish_reason
    assert {d.index for d in deltas} == set(range(len(out.outputs)))


def _same(out: RequestOutput, want: RequestOutput) -> None:
    assert (out.prompt_token_ids, out.token_ids, out.text, out.finish_reason) == (
        want.prompt_token_ids, want.token_ids, want.text, want.finish_reason
    )


def _assert_idle(llm: AsyncLLM) -> None:
    m = llm.metrics()
    assert m.kv_blocks_used == 0 and m.requests_running == 0 and m.requests_waiting == 0, m
    assert m.requests_total == m.requests_finished == sum(m.finish_reasons.values())
    info = llm.kv_cache_info  # the same count, as LLM reports it
    assert info["blocks_in_use"] == 0 and info["num_blocks"] == llm.engine.blocks.num_blocks


def test_threads_submitting_at_once_get_what_they_get_alone(async_llm, alone):
    llm = async_llm()
    barrier = threading.Barrier(len(CASES))
    results: list[tuple[list[StreamDelta], RequestOutput] | BaseException | None] = [None] * len(CASES)

    def client(i: int) -> None:
        try:
            prompt, params = CASES[i]
            barrier.wait()
            handle = llm.submit(prompt, params)
            deltas = list(handle)
            results[i] = deltas, handle.result()
        except BaseException as err:  # reported by the main thread
            results[i] = err

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(CASES))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result, want in zip(results, alone, strict=True):
        assert not isinstance(result, BaseException), result
        deltas, out = result
        _same(out, want)
        _check_stream(deltas, out)

    m = llm.metrics()
    _assert_idle(llm)
    assert m.requests_total == len(CASES)
    assert m.prompt_tokens_total == sum(len(w.prompt_token_ids) for w in alone)
    assert m.generation_tokens_total == sum(len(w.token_ids) for w in alone)
    assert sum(m.batch_size_histogram.values()) == m.num_steps
    assert max(m.batch_size_histogram) > 1  # the callers really were batched together
    assert m.ttft_seconds.count == len(CASES) and m.ttft_seconds.counts[-1] == len(CASES)
    assert m.tpot_seconds.count == sum(len(w.token_ids) > 1 for w in alone)
    assert m.finish_reasons == Counter(w.finish_reason for w in alone)


def test_asyncio_tasks_get_what_they_get_alone(async_llm, alone):
    llm = async_llm()

    async def client(prompt, params) -> tuple[list[StreamDelta], RequestOutput]:
        handle = llm.submit(prompt, params)
        deltas = [delta async for delta in handle]
        return deltas, await handle.wait()

    async def main():
        return await asyncio.gather(*(client(prompt, params) for prompt, params in CASES))

    for (deltas, out), want in zip(asyncio.run(main()), alone, strict=True):
        _same(out, want)
        _check_stream(deltas, out)
    _assert_idle(llm)


def test_stream_holds_back_stop_strings_and_partial_characters(tiny_checkpoint, async_llm):
    prompt = "日本語のテキスト 🎉"
    with LLM(str(tiny_checkpoint)) as sync:
        free = sync.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True))[0]
        stop = free.text[len(free.text) // 2 :][:3]  # some text the model will produce, probably across tokens
        cases = [
            SamplingParams(max_tokens=40, ignore_eos=True),
            SamplingParams(max_tokens=40, ignore_eos=True, stop=stop),
            SamplingParams(max_tokens=40, ignore_eos=True, n=2, seed=3, temperature=0.9, logprobs=1),
        ]
        want = [sync.generate(prompt, params)[0] for params in cases[:2]]
    assert want[1].finish_reason == "stop" and stop not in want[1].text
    llm = async_llm()
    handles = [llm.submit(prompt, params) for params in cases]
    streams = [list(handle) for handle in handles]
    for deltas, handle in zip(streams, handles, strict=True):
        _check_stream(deltas, handle.result())
    for handle, expected in zip(handles[:2], want, strict=True):
        _same(handle.result(), expected)
    assert {d.index for d in streams[2]} == {0, 1}


def test_cancel_mid_stream_frees_blocks_and_spares_the_others(async_llm, alone, monkeypatch):
    llm = async_llm()
    with Gate(llm, monkeypatch, pause_at=3) as gate:
        victim = llm.submit("a long story", LONG)
        others = [llm.submit(prompt, params) for prompt, params in CASES[:8]]
        gate.entered.wait()  # step 3 is under way: the victim has tokens and wants more
        victim.cancel()
        victim.cancel()  # idempotent
    out = victim.result()
    assert out.finish_reason == "abort" and 1 <= len(out.token_ids) <= 3
    for handle, want in zip(others, alone[:8], strict=True):
        _same(handle.result(), want)
    _check_stream(list(victim), out)
    victim.cancel()  # after the end: nothing happens
    _assert_idle(llm)
    assert llm.metrics().finish_reasons["abort"] == 1


def test_leaving_the_stream_cancels_the_request(async_llm, monkeypatch):
    llm = async_llm()
    with Gate(llm, monkeypatch, pause_at=2):
        handle = llm.submit("hello", LONG)
        for _ in handle:
            break  # the caller went away after one delta
    assert handle.result().finish_reason == "abort"

    async def main(gate: Gate) -> RequestOutput:
        handle = llm.submit("hello", LONG)
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in handle:
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()  # e.g. the HTTP client disconnected
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.release()
        return await handle.wait()

    with Gate(llm, monkeypatch, pause_at=2) as gate:
        assert asyncio.run(main(gate)).finish_reason == "abort"
    _assert_idle(llm)


def test_full_queue_is_refused_at_once(async_llm, alone, monkeypatch):
    llm = async_llm(max_waiting=2)
    with Gate(llm, monkeypatch, pause_at=2) as gate:
        running = llm.submit("keep the engine busy", LONG)
        gate.entered.wait()  # step 2 holds the engine: whatever comes now waits
        queued = [llm.submit(prompt, params) for prompt, params in CASES[:2]]
        assert llm.metrics().requests_waiting == 2
        with pytest.raises(QueueFullError, match="max_waiting"):
            llm.submit("one too many")
    for handle, want in zip(queued, alone[:2], strict=True):
        _same(handle.result(), want)
    assert running.result().finish_reason == "length"
    _same(llm.submit(*CASES[2]).result(), alone[2])  # room again
    assert llm.metrics().requests_total == 4


def test_close_ends_requests_in_flight_and_stops_the_thread(async_llm, monkeypatch):
    llm = async_llm()
    with Gate(llm, monkeypatch, pause_at=1) as gate:
        handles = [llm.submit("first", LONG)]
        gate.entered.wait()
        handles += [llm.submit(prompt, LONG) for prompt in TEXTS[:3]]  # still in the inbox
        closer = threading.Thread(target=llm.close)
        closer.start()
        while not llm._closed:  # close() has asked the engine thread to stop
            time.sleep(0.001)
    closer.join()
    assert not llm._thread.is_alive()
    assert [h.result().finish_reason for h in handles] == ["abort"] * 4
    assert len(handles[0].result().token_ids) == 1  # the step in progress completed
    assert llm.metrics().kv_blocks_used == 0 and llm.metrics().requests_finished == 4
    with pytest.raises(RuntimeError, match="closed"):
        llm.submit("too late")
    llm.close()  # idempotent


@pytest.mark.parametrize("where", ["model", "sampler"])
def test_failing_step_fails_only_its_request(async_llm, alone, monkeypatch, where):
    llm = async_llm(max_num_seqs=1)  # the first step holds the first request alone
    target, name = (llm.engine.runner, "run") if where == "model" else (llm.engine, "sampler")
    original, calls = getattr(target, name), []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, fail_once)
    doomed = llm.submit("doomed", LONG)
    handles = [llm.submit(prompt, params) for prompt, params in CASES[:4]]
    out = doomed.result()
    assert out.finish_reason == "error" and "injected failure" in doomed.error
    _check_stream(list(doomed), out)
    for handle, want in zip(handles, alone[:4], strict=True):
        _same(handle.result(), want)
        assert handle.error is None
    _same(llm.submit(*CASES[4]).result(), alone[4])  # still serving
    _assert_idle(llm)
    assert llm.metrics().finish_reasons["error"] == 1


def test_bad_input_raises_in_the_callers_thread(async_llm, alone):
    llm = async_llm()
    with pytest.raises(ValueError, match="empty"):
        llm.submit("")
    with pytest.raises(ValueError, match="vocabulary"):
        llm.submit([1, 2, 10**6])
    with pytest.raises(ValueError, match="n_positions"):
        llm.submit("hi", SamplingParams(max_tokens=200))
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.submit("hi", {"max_tokens": 3})
    with pytest.raises(TypeError, match="unknown AsyncLLM argument"):
        AsyncLLM("unused", max_batch=3)
    _same(llm.submit(*CASES[0]).result(), alone[0])
    assert llm.metrics().requests_total == 1


def test_metrics_export_as_prometheus_text(async_llm):
    llm = async_llm()
    llm.submit("hello", SamplingParams(max_tokens=5, ignore_eos=True)).result()
    text = llm.metrics().to_prometheus()
    assert "minigpt_generation_tokens_total 5\n" in text
    assert 'minigpt_requests_finished_total{finish_reason="length"} 1\n' in text
    assert 'minigpt_time_to_first_token_seconds_bucket{le="+Inf"} 1\n' in text
    assert "minigpt_time_per_output_token_seconds_count 1\n" in text
    assert "# TYPE minigpt_kv_blocks_used gauge\n" in text


def test_is_running_follows_close(tiny_checkpoint):
    llm = AsyncLLM(str(tiny_checkpoint), kv_cache_tokens=256)
    assert llm.is_running
    llm.close()
    assert not llm.is_running


def test_num_threads_is_restored_in_the_caller_s_thread_on_close(tiny_checkpoint):
    """The engine is built in the caller's thread and closed in its own; torch (OpenMP) keeps the thread count per
    thread, so close gives it back in the caller's."""
    import torch

    before = torch.get_num_threads()
    llm = AsyncLLM(str(tiny_checkpoint), kv_cache_tokens=256, num_threads=before + 1)
    assert torch.get_num_threads() == before + 1
    llm.close()
    assert torch.get_num_threads() == before


def test_beam_searches_submitted_from_threads_while_beams_run_get_what_they_get_alone(async_llm, tiny_checkpoint):
    """A beam group is built in its caller's thread while the engine thread steps the groups already running."""
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    prompts = [list(range(7 + i, 12 + 2 * i)) for i in range(6)]
    with LLM(str(tiny_checkpoint)) as llm:
        want = [[s.token_ids for s in out.sequences] for out in llm.beam_search(prompts, params)]
    llm = async_llm()
    results: list = [None] * (len(prompts) * 3)

    def client(i: int) -> None:
        try:
            handle = llm.submit_beam_search(prompts[i % len(prompts)], params)
            results[i] = [o.token_ids for o in handle.result().outputs]
        except BaseException as err:  # reported by the main thread
            results[i] = err

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, result in enumerate(results):
        assert not isinstance(result, BaseException), result
        assert result == want[i % len(prompts)]
    _assert_idle(llm)
