"""CUDA graphs for decode (minigpt/engine/cuda_graphs.py).

On the CPU the graphs' own logic runs with a capture that replays by calling the step again: the ladder,
the bucket a batch pads to, the static buffers and their padding rows, the graph-or-eager choice. With a
CUDA device (marked `cuda`), real graphs are captured and compared with the eager engine token for token.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from minigpt import LLM, SamplingParams
from minigpt.cli import add_engine_arguments, engine_args_from
from minigpt.engine.config import EngineConfig
from minigpt.engine.cuda_graphs import DecodeGraphs, capture_sizes
from minigpt.engine.kv_cache import FreeBlocks

from conftest import assert_all_free, hf_greedy, hf_model, needs_cuda, random_prompts

LENGTHS = [1, 7, 8, 9, 30, 64]
MAX_TOKENS = [12, 9, 20, 2, 16, 30]  # sequences finish at different steps: the batch shrinks through the ladder


def replay_by_calling(fn, pool):
    """A stand-in for a CUDA graph on the CPU: each replay runs the captured step again and, as a graph
    does, writes its output into the one tensor the capture returned."""
    out = fn()

    def replay():
        return out.copy_(fn())

    return replay


def test_capture_sizes_are_a_ladder_up_to_the_largest_batch():
    assert capture_sizes(128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]


def test_a_batch_replays_the_smallest_size_that_holds_it():
    graphs = DecodeGraphs(None, capture_sizes(40), max_blocks=4, scratch_block=3, block_size=8,
                          device=torch.device("cpu"))
    assert [graphs.bucket(b) for b in (1, 2, 3, 5, 8, 9, 16, 17, 33, 40)] == [1, 2, 4, 8, 8, 16, 16, 32, 40, 40]
    # static buffers of the largest size; the block tables as wide as the model's context
    assert graphs.input_ids.shape == (40,) and graphs.tables.shape == (40, 4)
    assert (graphs.slots == 3 * 8).all() and (graphs.tables == 3).all() and (graphs.lens == 1).all()


def test_cpu_engine_captures_no_graph_and_keeps_no_scratch_block(tiny_checkpoint):
    with LLM(str(tiny_checkpoint), block_size=8, kv_cache_tokens=256) as llm:
        runner = llm.engine.runner
        assert not isinstance(runner.forward_path, DecodeGraphs)
        assert runner.pool.kv.shape[2] == runner.pool.num_blocks == 32


def test_enforce_eager_is_a_switch():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_args_from(parser.parse_args(["--enforce-eager"]))["enforce_eager"] is True
    assert engine_args_from(parser.parse_args([]))["enforce_eager"] is False
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        EngineConfig(enforce_eager="yes")


def with_graphs(llm: LLM, max_batch: int) -> Counter:
    """Give a CPU engine decode graphs replayed by calling, over a block taken from its free list; returns a
    counter of the batch sizes replayed."""
    engine = llm.engine
    runner = engine.runner
    scratch = engine.blocks.num_blocks - 1
    engine.blocks.free = FreeBlocks(scratch)  # every block but the last: one no sequence will own
    graphs = DecodeGraphs(runner.forward, capture_sizes(max_batch), -(-engine.model_config.n_positions // 8),
                          scratch, 8, runner.device, capture=replay_by_calling)
    graphs.capture_all()
    replayed = Counter()
    for size, replay in list(graphs.graphs.items()):
        graphs.graphs[size] = lambda replay=replay, size=size: replayed.update([size]) or replay()
    runner.forward_path = graphs
    return replayed


def run(path, max_batch: int | None, logprobs: int = 2):
    """Tokens, logprobs and the pool of an engine whose decode steps replay graphs of up to `max_batch`
    sequences (None: eager), with a counter of the sizes replayed."""
    with LLM(str(path), block_size=8, kv_cache_tokens=1024) as llm:
        replayed = with_graphs(llm, max_batch) if max_batch else Counter()
        params = [SamplingParams(max_tokens=m, ignore_eos=True, logprobs=logprobs) for m in MAX_TOKENS]
        outs = llm.generate(random_prompts(LENGTHS), params)
        pool = llm.engine.runner.pool.kv.clone()
        if max_batch:
            scratch = llm.engine.runner.forward_path.scratch_block
            pool[:, :, scratch] = 0  # padding rows' block
            llm.engine.blocks.free.put(scratch, cached=False)
        assert_all_free(llm)
    return [o.token_ids for o in outs], [o.logprobs for o in outs], pool, replayed


@pytest.mark.parametrize("max_batch", [8, 4])
def test_replayed_decode_steps_give_the_eager_tokens(tiny_checkpoint, max_batch):
    """Six sequences finishing at different steps replay padded sizes (6 -> 8, 5 -> 8, 3 -> 4, ...); with
    graphs of up to 4, the steps of 5 and 6 sequences run eagerly. Tokens equal the eager engine's,
    logprobs too (to float rounding: the CPU's products may sum a padded batch in another order), and
    padding rows wrote only the scratch block: the pools hold the same K/V."""
    tokens, logprobs, pool, replayed = run(tiny_checkpoint, max_batch)
    want_tokens, want_logprobs, want_pool, _ = run(tiny_checkpoint, None)
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs, strict=True):
        torch.testing.assert_close([t.logprob for t in got], [t.logprob for t in want], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, want_pool, rtol=1e-5, atol=1e-5)
    assert set(replayed) == {1, 2, 4} | ({8} if max_batch == 8 else set())
    assert sum(replayed.values()) < max(MAX_TOKENS)  # the prompts' first step and larger batches ran eagerly


def test_logits_outlive_the_next_replay(tiny_checkpoint):
    with LLM(str(tiny_checkpoint), block_size=8, kv_cache_tokens=1024) as llm:
        with_graphs(llm, 4)
        engine = llm.engine
        engine.add(engine.make_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)))
        engine.step()  # the prompt
        runner, kept = engine.runner, []
        run = runner.run
        runner.run = lambda inputs: kept.append(run(inputs)) or kept[-1]
        engine.step()
        first = kept[0].clone()
        engine.step()
        assert torch.equal(kept[0], first) and not torch.equal(kept[1], first)


def test_padding_rows_are_reset_after_a_larger_step(tiny_checkpoint):
    with LLM(str(tiny_checkpoint), block_size=8, kv_cache_tokens=1024) as llm:
        with_graphs(llm, 8)
        engine, graphs = llm.engine, llm.engine.runner.forward_path
        for prompt in random_prompts([5, 9, 20]):
            engine.add(engine.make_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
        engine.step()  # prefills
        graphs.slots.fill_(7)  # as a step of 8 real sequences would leave them
        graphs.lens.fill_(99)
        engine.step()  # three sequences replay size 4
        assert graphs.slots[3].item() == graphs.scratch_slot and graphs.lens[3].item() == 1
        assert (graphs.tables[3] == graphs.scratch_block).all()
        assert graphs.lens[:3].tolist() == [6, 10, 21]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_equal_the_eager_engine(tiny_checkpoint, dtype):
    """Real graphs against `enforce_eager=True` on the GPU: four sequences decoding together replay
    size 4, so every product has the eager step's shape, and tokens and logprobs are bitwise equal."""
    prompts = random_prompts([3, 17, 40, 64])
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3)
    results = []
    for eager in (False, True):
        with LLM(str(tiny_checkpoint), device="cuda", dtype=dtype, enforce_eager=eager, block_size=8) as llm:
            assert (not isinstance(llm.engine.runner.forward_path, DecodeGraphs)) == eager
            outs = llm.generate(prompts, params)
            results.append([(o.token_ids, o.logprobs) for o in outs])
            assert_all_free(llm)
    assert results[0] == results[1]


@pytest.mark.cuda
@needs_cuda
def test_cuda_engine_with_graphs_gives_transformers_tokens(tiny_checkpoint):
    """fp32 on the GPU, graphs on, sequences finishing at different steps (padded replays): greedy tokens
    equal transformers' on the same GPU."""
    reference = hf_model(tiny_checkpoint).to("cuda")
    prompts = random_prompts(LENGTHS)
    want = [hf_greedy(reference, p, m) for p, m in zip(prompts, MAX_TOKENS, strict=True)]
    with LLM(str(tiny_checkpoint), device="cuda", block_size=8) as llm:
        assert isinstance(llm.engine.runner.forward_path, DecodeGraphs)
        outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS])
    assert [o.token_ids for o in outs] == want
