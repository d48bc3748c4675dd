"""The compiled steps (`compile=True`): their pure functions must compute what the engine's eager
paged step computes, and the compiled engine must stay token-exact with transformers."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from minigpt import LLM, SamplingParams
from minigpt.compile.steps import CompiledRows, LayerProgram, attention_scales, decode_step
from minigpt.model.attention import PagedAttention
from minigpt.model.backends import TorchBackend

from conftest import assert_all_free, hf_greedy, hf_model, random_prompts

# Around the block boundaries of block_size=8, and long enough to grow several blocks.
LENGTHS = [1, 7, 8, 9, 30, 64]
MAX_TOKENS = [12, 9, 20, 2, 16, 30]


def eager_step(runner, inputs, kv=None):
    """The model runner's eager paged step on the torch reference backend, into `kv` (default: the pool)."""
    kv = runner.pool.kv if kv is None else kv
    attention = PagedAttention(kv, inputs.meta, TorchBackend(), runner.scales, runner.upcast)
    return runner.model.run(inputs.input_ids, inputs.positions, attention, inputs.logits_indices)


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [("float32", None), ("bfloat16", None), ("float32", "bfloat16"), ("float32", "float16")],
)
@pytest.mark.parametrize("block_size", [8, 16])
def test_pure_decode_step_equals_the_paged_step(tiny_checkpoint, dtype, kv_cache_dtype, block_size):
    """`decode_step` over `decode_layer` (what the compiled decode runs, eagerly) gives the eager paged
    step's logits and stores the same K/V. With a half-precision pool both read the same rounded blocks;
    only the new token's own K/V differs (the eager step reads it back rounded from the pool, the pure
    step uses it as computed)."""
    prompts = random_prompts(LENGTHS)
    with LLM(str(tiny_checkpoint), dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size) as llm:
        engine = llm.engine
        for prompt in prompts:
            engine.add(engine.make_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
        engine.step()  # prefills every prompt and samples its first token
        for _ in range(2):  # then decode-only steps: the pure one into a copy of the pool, the eager one after
            batch = engine.scheduler.schedule()
            inputs = engine.runner.prepare(batch.chunks, batch.decodes)
            meta = inputs.meta
            assert not meta.prefills
            pool = engine.runner.pool.kv.clone()
            with torch.inference_mode():
                logits = decode_step(
                    engine.runner.model, inputs.input_ids, inputs.positions, pool, meta.decode_block_tables,
                    meta.decode_context_lens, meta.slot_mapping, attention_scales(engine.runner.model),
                )
                want = eager_step(engine.runner, inputs)
            exact = dtype == "float32" and kv_cache_dtype is None
            # half precision: ~2 bf16 ulps at this model's largest logits (|logit| < 4, ulp 2^-6)
            tol = dict(rtol=1e-5, atol=1e-5) if exact else dict(rtol=2e-2, atol=3e-2)
            torch.testing.assert_close(logits, want, **tol)
            torch.testing.assert_close(pool, engine.runner.pool.kv, **tol)  # the same K/V, at the same slots
            for seq, token in zip(inputs.sample_seqs, want.argmax(-1).tolist(), strict=True):
                seq.num_computed_tokens += 1
                seq.append(token, None)


@pytest.mark.slow
def test_compiled_prompt_steps_equal_the_eager_ones(tiny_checkpoint):
    """Steps of a compiled engine with prompts (here: several at once) run each block's halves around
    `prompt_attention` through one program per half, shared by every layer (each layer's tensors are its
    inputs), and compute what the eager paged step computes."""
    with LLM(str(tiny_checkpoint), compile=True, block_size=8) as llm:
        engine = llm.engine
        for prompt in random_prompts(LENGTHS):
            engine.add(engine.make_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
        runner = engine.runner
        batch = engine.scheduler.schedule()
        inputs = runner.prepare(batch.chunks, batch.decodes)
        assert len(inputs.meta.prefills) == len(LENGTHS)
        compiled = runner.forward_path.halves
        assert all(isinstance(half, LayerProgram) for half in compiled)
        pool = runner.pool.kv.clone()
        with torch.inference_mode():
            got = runner.forward_path(inputs)
            want = eager_step(runner, inputs, kv=pool)
            x = torch.randn(5, runner.model.config.n_embd)
            for block in runner.model.h:  # each layer its own results, not the first one's
                torch.testing.assert_close(compiled[0](block, x), block.attention_inputs(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(runner.pool.kv, pool, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_engine_equals_transformers(tiny_checkpoint):
    """Batched, then alone (a lone prompt through the compiled halves, then batch 1's decodes through the
    decode program of one row), token-exact with transformers; close() frees the pool."""
    reference = hf_model(tiny_checkpoint)
    prompts = random_prompts(LENGTHS)
    want = [hf_greedy(reference, p, m) for p, m in zip(prompts, MAX_TOKENS, strict=True)]
    with LLM(str(tiny_checkpoint), compile=True, block_size=8) as llm:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS])
        assert [o.token_ids for o in outs] == want
        for fresh in random_prompts([1, 13, 60], seed=99):
            alone = llm.generate([fresh], SamplingParams(max_tokens=10, ignore_eos=True))[0]
            assert alone.token_ids == hf_greedy(reference, fresh, 10)
        assert_all_free(llm)
        pool = weakref.ref(llm.engine.runner.pool.kv)
    gc.collect()
    assert pool() is None  # close() freed the pool: the compiled steps hold no reference to it


def test_decodes_among_prompts_run_the_decode_program_and_equal_transformers(tiny_checkpoint, monkeypatch):
    """Steps that mix prompt chunks with decodes run their decodes through the decode programs (of one row
    and of several), as decode steps do, token-exact with transformers."""
    reference = hf_model(tiny_checkpoint)
    # a budget of 24 tokens a step: prompts are chunked and prefilled next to the decodes of earlier ones;
    # with [5, 64], one sequence decodes next to the other's chunks
    batches = [(random_prompts(LENGTHS, seed=7), MAX_TOKENS), (random_prompts([5, 64], seed=8), [12, 4])]
    with LLM(str(tiny_checkpoint), compile=True, block_size=8, max_num_batched_tokens=24) as llm:
        steps, rows, inside = llm.engine.runner.forward_path, [], []
        layer, (layer_alone, head_alone), block = steps.layer, steps.alone, CompiledRows.block

        def counted(program):
            return lambda block, x, *args: rows.append((len(x), bool(inside))) or program(block, x, *args)

        def prompt_step_block(self, *args):
            inside.append(self)
            try:
                return block(self, *args)
            finally:
                inside.pop()

        monkeypatch.setattr(CompiledRows, "block", prompt_step_block)
        monkeypatch.setattr(steps, "layer", counted(layer))
        monkeypatch.setattr(steps, "alone", (counted(layer_alone), head_alone))
        for prompts, max_tokens in batches:
            outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens])
            want = [hf_greedy(reference, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
            assert [o.token_ids for o in outs] == want
        among_prompts = [n for n, mixed in rows if mixed]
        assert len(among_prompts) % llm.engine.runner.model.config.n_layer == 0
        assert 1 in among_prompts and max(among_prompts) > 1


@pytest.mark.slow
def test_compiled_engines_keep_their_own_models(tiny_checkpoint, checkpoint_factory):
    """The compiled programs hold no weights: engines alive at once, on models of one shape (which share
    one cache entry), of other attention scales and of another shape, each give their own eager tokens,
    called in turn (batched, then alone)."""
    checkpoints = [
        tiny_checkpoint,
        checkpoint_factory(seed=3),
        checkpoint_factory(seed=1, scale_attn_by_inverse_layer_idx=True),
        checkpoint_factory(seed=2, n_layer=3),
    ]
    prompts = random_prompts([5, 9, 17])
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = []
    for checkpoint in checkpoints:
        with LLM(str(checkpoint)) as llm:
            want.append([o.token_ids for o in llm.generate(prompts, params)])
    assert want[0] != want[1] and want[0] != want[2]
    engines = [LLM(str(checkpoint), compile=True) for checkpoint in checkpoints]
    try:
        for _ in range(2):
            for llm, tokens in zip(engines, want, strict=True):
                assert [o.token_ids for o in llm.generate(prompts, params)] == tokens
                assert llm.generate([prompts[2]], params)[0].token_ids == tokens[2]
    finally:
        for llm in engines:
            llm.close()
