"""Overlap (`overlap="on"`, the default on CUDA): a step whose tokens are drawn on the device launches the next
step before it reads them. Outputs are the ones the engine gives without it, on the CPU here, with a device
stand-in that sleeps to show the next step is launched while the last one's tokens are still on their way."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

import minigpt.engine.engine
from minigpt import LLM, SamplingParams
from minigpt.common.errors import ParamError
from minigpt.common.transfer import HostCopy
from minigpt.engine.config import EngineConfig
from minigpt.engine.runner import ModelRunner
from minigpt.sampling import Sampler

from conftest import assert_all_free, needs_cuda, random_prompts

PROMPTS = random_prompts([5, 12, 3, 30, 9, 17], seed=3)


def outcome(outputs) -> list[tuple]:
    return [(out.outputs[0].token_ids, out.outputs[0].text, out.outputs[0].finish_reason,
             [(lp.logprob, sorted(lp.top.items())) for lp in out.outputs[0].logprobs or []]) for out in outputs]


def generate(path, overlap: str, prompts, params, **config) -> list[tuple]:
    llm = LLM(str(path), overlap=overlap, **config)
    try:
        outputs = llm.generate(prompts, params)
        assert_all_free(llm)
        return outcome(outputs)
    finally:
        llm.close()


def mixed_params(stop: str) -> list[SamplingParams]:
    """Requests finishing at different steps, by length, EOS or a stop string; seeded draws; a penalised
    request and one asking for logprobs (their steps are not overlapped)."""
    return [
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(max_tokens=4, temperature=1.0, top_k=20, seed=1, min_tokens=3),
        SamplingParams(max_tokens=20, temperature=0.0, stop=[stop]),
        SamplingParams(max_tokens=11, temperature=0.7, seed=3, repetition_penalty=1.3),
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=2),
    ]


def stop_string(path) -> str:
    """A piece of text the greedy continuation of PROMPTS[3] produces, so a stop string matches mid-way."""
    text = generate(path, "off", [PROMPTS[3]], SamplingParams(max_tokens=20, temperature=0.0))[0][1]
    return text[len(text) // 2 : len(text) // 2 + 2]


def test_outputs_are_the_same_with_and_without_overlap(tiny_checkpoint) -> None:
    """batch_invariant: a request's bits do not depend on its company, as overlap's steps keep a finished
    sequence's row one step longer than the steps without it."""
    params = mixed_params(stop_string(tiny_checkpoint))
    without = generate(tiny_checkpoint, "off", PROMPTS, params, batch_invariant=True)
    assert generate(tiny_checkpoint, "on", PROMPTS, params, batch_invariant=True) == without
    assert any(reason == "stop" for _, _, reason, _ in without)


def test_same_length_requests_are_the_same_in_the_default_mode(tiny_checkpoint) -> None:
    """Requests that all run to the same length have the same company in every step with overlap or without."""
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=11, ignore_eos=True)
    assert generate(tiny_checkpoint, "on", PROMPTS, params) == generate(tiny_checkpoint, "off", PROMPTS, params)


def test_preemption_and_chunked_prefill_under_overlap(tiny_checkpoint) -> None:
    """A pool too small for every request (preemption, steps read unoverlapped) and a step budget that chunks
    prompts: the same outputs."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    config = dict(batch_invariant=True, kv_cache_tokens=96, block_size=16, max_num_batched_tokens=20)
    assert generate(tiny_checkpoint, "on", PROMPTS, params, **config) == generate(
        tiny_checkpoint, "off", PROMPTS, params, **config)


def test_a_step_laid_out_ahead_gives_each_drawn_token_a_slot_of_its_own(tiny_checkpoint, monkeypatch) -> None:
    """A step laid out ahead grows the tables whose drawn token starts a block: each decode's position is in its
    table, in a block no other table holds; blocks are short for some (the step is read first), and requests
    finish and are admitted between."""
    laid_out = []
    prepare = ModelRunner.prepare

    def checked(self, chunks, decodes=(), ahead=None):
        bs, counts = self.config.block_size, Counter(b for seq in decodes for b in seq.block_table)
        positions = [len(seq.token_ids) - 1 + (ahead is not None) for seq in decodes]
        for seq, position in zip(decodes, positions, strict=True):
            assert position < len(seq.block_table) * bs and counts[seq.block_table[position // bs]] == 1
        if ahead is not None:
            laid_out.append(any(position % bs == 0 for position in positions))  # a block begun
        return prepare(self, chunks, decodes, ahead)

    monkeypatch.setattr(ModelRunner, "prepare", checked)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (30, 9, 21, 40, 14, 26)]
    config = dict(batch_invariant=True, kv_cache_tokens=120, block_size=8, max_num_seqs=4)
    overlapped = generate(tiny_checkpoint, "on", PROMPTS, params, **config)
    assert len(laid_out) > 10 and any(laid_out)
    assert overlapped == generate(tiny_checkpoint, "off", PROMPTS, params, **config)


class SleepyCopy(HostCopy):
    """A device stand-in: its tokens are ready `delay` seconds after they were drawn; launches and reads logged."""

    delay = 0.003
    log: list[tuple[str, int]] = []

    def __init__(self, tensor) -> None:
        super().__init__(tensor)
        self.ready = time.perf_counter() + self.delay
        self.index = sum(event == "drawn" for event, _ in self.log)
        self.log.append(("drawn", self.index))

    def tolist(self) -> list:
        time.sleep(max(0.0, self.ready - time.perf_counter()))
        self.log.append(("read", self.index))
        return super().tolist()


def test_the_next_step_is_launched_before_the_tokens_are_read(tiny_checkpoint, monkeypatch) -> None:
    monkeypatch.setattr(minigpt.engine.engine, "HostCopy", SleepyCopy)
    monkeypatch.setattr(SleepyCopy, "log", [])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tiny_checkpoint), overlap="on")
    try:
        overlapped = outcome(llm.generate(PROMPTS[:3], params))
    finally:
        llm.close()
    # the prefill step and 5 decodes drawn, then one decode more for sequences already finished (never read)
    assert SleepyCopy.log[:4] == [("drawn", 0), ("drawn", 1), ("read", 0), ("drawn", 2)]
    reads = [i for event, i in SleepyCopy.log if event == "read"]
    assert reads == list(range(6))
    for i in reads[:-1]:
        assert SleepyCopy.log.index(("drawn", i + 1)) < SleepyCopy.log.index(("read", i))
    assert overlapped == generate(tiny_checkpoint, "off", PROMPTS[:3], params)


def test_stream_and_abort_while_a_step_runs_ahead(tiny_checkpoint) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tiny_checkpoint), overlap="on")
    try:
        stream = llm.stream(PROMPTS[0], params)
        next(stream), next(stream)
        stream.close()  # aborted with a step launched ahead for it
        assert_all_free(llm)
        whole = "".join(llm.stream(PROMPTS[0], params))
        assert outcome(llm.generate([PROMPTS[0]], params)) == generate(tiny_checkpoint, "off", [PROMPTS[0]], params)
        assert whole == outcome(llm.generate([PROMPTS[0]], params))[0][1]
        assert_all_free(llm)
    finally:
        llm.close()


def test_draw_ahead_is_the_draw_a_token_later() -> None:
    """`Sampler.draw(ahead=1)` before a token is appended gives what the sampler gives after."""
    class Row:
        def __init__(self, params, outputs):
            self.params, self.seed, self.prompt_token_ids, self.output_token_ids = params, 5, [1, 2], outputs

    sampler = Sampler(64, eos_token_ids=[0])
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.9, seed=5), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, min_tokens=3, seed=2)]
    before, after = [Row(p, [4, 9]) for p in params], [Row(p, [4, 9, 1]) for p in params]
    assert sampler.draw(logits, before, ahead=1).tolist() == sampler(logits, after).token_ids
    with pytest.raises(ValueError, match="penalties"):
        sampler.draw(logits, [Row(SamplingParams(presence_penalty=0.5), [4])], ahead=1)


def test_overlap_setting() -> None:
    assert not EngineConfig().overlapped and EngineConfig(device="cuda").overlapped
    assert EngineConfig(overlap="on").overlapped and not EngineConfig(device="cuda", overlap="off").overlapped
    with pytest.raises(ParamError, match="overlap must be one of"):
        EngineConfig(overlap=True)


@pytest.mark.cuda
@needs_cuda
def test_cuda_overlap_is_on_by_default_and_gives_the_same_tokens(tiny_checkpoint) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=4, ignore_eos=True)
    assert generate(tiny_checkpoint, "auto", PROMPTS, params, device="cuda") == generate(
        tiny_checkpoint, "off", PROMPTS, params, device="cuda")
