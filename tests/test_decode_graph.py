"""The compiled steps (`compile=True`): their pure functions must compute what the engine's eager
paged step computes, and the compiled engine must stay token-exact with transformers."""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import pytest
import torch

import minigpt.compiled
from minigpt import LLM, SamplingParams
from minigpt.attention import PagedAttention
from minigpt.attention_backends import TorchBackend
from minigpt.compiled import CompiledSteps, attention_scales, decode_step, prefill_step, weights_fingerprint
from minigpt.cpu_linear import PackedLinear
from minigpt.model import GPT2, attention_inputs, attention_outputs, replace_linears
from minigpt.quantize import quantize

from conftest import assert_all_free, hf_greedy, hf_model, random_prompts

# Around the block boundaries of block_size=8, and long enough to grow several pages.
LENGTHS = [1, 7, 8, 9, 30, 64]
MAX_TOKENS = [12, 9, 20, 2, 16, 30]


def eager_step(runner, inputs, kv=None, halves=(attention_inputs, attention_outputs)):
    """The model runner's eager paged step on the torch reference backend, into `kv` (default: the pool)."""
    kv = runner.pool.kv if kv is None else kv
    attention = PagedAttention(kv, inputs.meta, TorchBackend(), runner.scales, runner.upcast)
    return runner.model.run(inputs.input_ids, inputs.positions, attention, inputs.logits_indices, halves)


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [("float32", None), ("bfloat16", None), ("float32", "bfloat16"), ("float32", "float16")],
)
@pytest.mark.parametrize("block_size", [8, 16])
def test_pure_decode_step_equals_the_paged_step(tiny_checkpoint, dtype, kv_cache_dtype, block_size):
    """With a half-precision pool both read the same rounded pages; only the new token's own K/V
    differs (the eager step reads it back rounded from the pool, the pure step uses it as computed)."""
    prompts = random_prompts(LENGTHS)
    with LLM(str(tiny_checkpoint), dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size) as llm:
        engine = llm.engine
        for prompt in prompts:
            engine.add(engine.make_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
        engine.step()  # prefills every prompt and samples its first token
        for _ in range(2):  # then decode-only steps: compare them before the eager step runs
            inputs = engine.runner.prepare(engine.scheduler.schedule().chunks)
            meta = inputs.meta
            assert not meta.prefills
            with torch.inference_mode():
                logits, new_kv = decode_step(
                    engine.runner.model, inputs.input_ids, inputs.positions, engine.runner.pool.kv,
                    meta.decode_block_tables, meta.decode_context_lens, attention_scales(engine.runner.model),
                )
                want = eager_step(engine.runner, inputs)
            exact = dtype == "float32" and kv_cache_dtype is None
            # half precision: ~2 bf16 ulps at this model's largest logits (|logit| < 4, ulp 2^-6)
            tol = dict(rtol=1e-5, atol=1e-5) if exact else dict(rtol=2e-2, atol=3e-2)
            torch.testing.assert_close(logits, want, **tol)
            slots = engine.runner.pool.kv.flatten(2, 3)[:, :, meta.slot_mapping]  # what the eager step wrote
            assert new_kv.dtype == slots.dtype  # ready to store: the cast is fused into the step
            torch.testing.assert_close(new_kv, slots, **tol)
            for seq, token in zip(inputs.sample_seqs, want.argmax(-1).tolist(), strict=True):
                seq.num_computed_tokens += 1
                seq.append(token, None)


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("float32", None), ("bfloat16", None), ("float32", "float16")])
@pytest.mark.parametrize("length", [2, 9, 64])
def test_pure_prefill_step_equals_the_paged_step(tiny_checkpoint, dtype, kv_cache_dtype, length):
    with LLM(str(tiny_checkpoint), dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=8) as llm:
        engine = llm.engine
        engine.add(engine.make_request(random_prompts([length])[0], SamplingParams(max_tokens=2)))
        inputs = engine.runner.prepare(engine.scheduler.schedule().chunks)
        assert CompiledSteps.covers(inputs)
        meta = inputs.meta
        runner = engine.runner
        with torch.inference_mode():
            logits, new_kv = prefill_step(runner.model, inputs.input_ids, inputs.positions, runner.pool.kv.dtype)
            want = eager_step(runner, inputs)
        exact = dtype == "float32" and kv_cache_dtype is None
        tol = dict(rtol=1e-5, atol=1e-5) if exact else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(logits, want, **tol)
        slots = runner.pool.kv.flatten(2, 3)[:, :, meta.slot_mapping]
        assert new_kv.dtype == slots.dtype  # ready to store: the cast is fused into the step
        torch.testing.assert_close(new_kv, slots, **tol)


@pytest.mark.slow
def test_compiled_block_halves_equal_the_eager_ones(tiny_checkpoint):
    """Eager steps of a compiled engine (here: several prompts at once) run each block's halves around
    attention through one compiled graph per half, shared by every layer, compiled by the warmup."""
    with LLM(str(tiny_checkpoint), compile=True, block_size=8) as llm:
        engine = llm.engine
        for prompt in random_prompts(LENGTHS):
            engine.add(engine.make_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
        runner = engine.runner
        inputs = runner.prepare(engine.scheduler.schedule().chunks)
        assert len(inputs.meta.prefills) == len(LENGTHS)
        compiled = runner.compiled.halves
        assert compiled != (attention_inputs, attention_outputs)
        pool = runner.pool.kv.clone()
        with torch.inference_mode():
            with torch._dynamo.config.patch(error_on_recompile=True):
                got = eager_step(runner, inputs, halves=compiled)
            want = eager_step(runner, inputs, kv=pool)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(runner.pool.kv, pool, rtol=1e-5, atol=1e-5)
        # compiled unfrozen also where the steps freeze: frozen, one layer's weights would be constants
        # of the graph every layer runs, and the next layer would get the first one's results
        before, _ = CompiledSteps(runner.model, runner.pool, {"freezing": True}).halves
        x = torch.randn(5, runner.model.config.n_embd)
        with torch.inference_mode():
            for block in runner.model.h[:2]:
                torch.testing.assert_close(before(block, x), attention_inputs(block, x), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_engine_equals_transformers(tiny_checkpoint, monkeypatch):
    reference = hf_model(tiny_checkpoint)
    prompts = random_prompts(LENGTHS)
    want = [hf_greedy(reference, p, m) for p, m in zip(prompts, MAX_TOKENS, strict=True)]
    with LLM(str(tiny_checkpoint), compile=True, block_size=8) as llm:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS])
        assert [o.token_ids for o in outs] == want
        graph, prefills = llm.engine.runner.compiled, []
        compiled_prefill = graph.prefill
        graph.prefill = lambda *args: prefills.append(args) or compiled_prefill(*args)
        # nothing cached: the lone-prompt graph up to PREFILL_MAX_TOKENS (here 20), the paged step past it,
        # then batch 1's graph; all compiled by the warmup
        monkeypatch.setattr(minigpt.compiled, "PREFILL_MAX_TOKENS", 20)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for fresh in random_prompts([13, 20, 21, 60], seed=99):
                alone = llm.generate([fresh], SamplingParams(max_tokens=10, ignore_eos=True))[0]
                assert alone.token_ids == hf_greedy(reference, fresh, 10)
        monkeypatch.undo()
        assert [len(args[0]) for args in prefills] == [13, 20]
        assert_all_free(llm)
        pool = weakref.ref(llm.engine.runner.pool.kv)
    gc.collect()
    assert pool() is None  # close() freed the pool: the compiled step holds no reference to it


def test_decodes_among_prompts_attend_compiled_and_equal_transformers(tiny_checkpoint, monkeypatch):
    """Steps that mix prompt chunks with decodes run eagerly around attention; with compile=True their
    decodes attend through the compiled `paged_decode` (every layer, batch 1 and more, without a
    recompile: each layer's pages are other offsets into the one pool), token-exact with transformers."""
    reference = hf_model(tiny_checkpoint)
    # a budget of 24 tokens a step: prompts are chunked and prefilled next to the decodes of earlier ones;
    # with [5, 64], one sequence decodes next to the other's chunks
    batches = [(random_prompts(LENGTHS, seed=7), MAX_TOKENS), (random_prompts([5, 64], seed=8), [12, 4])]
    with LLM(str(tiny_checkpoint), compile=True, block_size=8, max_num_batched_tokens=24) as llm:
        backend, rows = llm.engine.runner.compiled.decode_backend, []
        attend = backend._attend
        monkeypatch.setattr(backend, "_attend", lambda query, *args: rows.append(len(query)) or attend(query, *args))
        with torch._dynamo.config.patch(error_on_recompile=True):
            for prompts, max_tokens in batches:
                outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens])
                want = [hf_greedy(reference, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
                assert [o.token_ids for o in outs] == want
        assert len(rows) % llm.engine.runner.model.config.n_layer == 0 and 1 in rows and max(rows) > 1


@pytest.mark.slow
def test_every_compiled_graph_skips_the_guards_on_the_model(tiny_checkpoint):
    """torch.compile pops `guard_filter_fn` from the options dict it is given: each compiled function
    needs a dict of its own, or all but the first check every weight's guards on every call (a lone
    prompt's step: ~40-80 us a call)."""
    skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    if skip is None:
        pytest.skip("guard filters need torch >= 2.7")
    filtered: list[set[str]] = []
    record = lambda entries: filtered.append({entry.name for entry in entries}) or skip(entries)  # noqa: E731
    with mock.patch.object(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", record):
        with LLM(str(tiny_checkpoint), compile=True):  # warmup compiles every graph
            pass
    assert sum("kv_pool" in names for names in filtered) == 2  # decode steps: batch >= 2 and batch 1
    assert sum("positions" in names and "kv_pool" not in names for names in filtered) == 1  # a lone prompt
    assert sum("block" in names and "y" not in names for names in filtered) == 2  # before attention: T and 1 tokens
    assert sum("block" in names and "y" in names for names in filtered) == 2  # after attention


@pytest.mark.slow
def test_compiled_engines_keep_their_own_models(tiny_checkpoint, checkpoint_factory):
    """Each engine compiles private copies of the steps, whose guards on the model are skipped: engines
    alive at once, on models of the same shapes (one with other attention scales, constants inside the
    graph) and of another shape, each give their own eager tokens, called in turn (batched, then alone
    through the prompt and batch-1 graphs)."""
    checkpoints = [
        tiny_checkpoint,
        checkpoint_factory(seed=1, scale_attn_by_inverse_layer_idx=True),
        checkpoint_factory(seed=2, n_layer=3),
    ]
    prompts = random_prompts([5, 9, 17])
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = []
    for checkpoint in checkpoints:
        with LLM(str(checkpoint)) as llm:
            want.append([o.token_ids for o in llm.generate(prompts, params)])
    assert want[0] != want[1]
    engines = [LLM(str(checkpoint), compile=True) for checkpoint in checkpoints]
    try:
        for _ in range(2):
            for llm, tokens in zip(engines, want, strict=True):
                assert [o.token_ids for o in llm.generate(prompts, params)] == tokens
                assert llm.generate([prompts[2]], params)[0].token_ids == tokens[2]
    finally:
        for llm in engines:
            llm.close()


def test_weights_fingerprint_follows_every_byte_of_the_weights(tiny_checkpoint):
    """The tag on the disk cache's key for frozen graphs: the same for the same weights (a second start
    hits the cache), different when any parameter or buffer differs anywhere (a fine-tune misses it)."""
    # the models as loaded, with nn.Linear weights (an engine may swap in packed linears on some CPUs)
    first, second = GPT2.from_pretrained(tiny_checkpoint), GPT2.from_pretrained(tiny_checkpoint)
    assert weights_fingerprint(first) == weights_fingerprint(second)
    with torch.no_grad():
        second.h[1].mlp.c_proj.weight[-1, -1] += 1e-3
    assert weights_fingerprint(first) != weights_fingerprint(second)
    quantize(first, "int8")
    tag = weights_fingerprint(first)
    with torch.no_grad():
        first.h[0].attn.c_attn.scales[3] *= 2  # a buffer of the quantized model
    assert weights_fingerprint(first) != tag


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_weights_fingerprint_reads_packed_weights(tiny_checkpoint):
    """oneDNN's packed weights (PackedLinear: bf16 CPUs, fp32 on AVX2 ones) are opaque tensors with no
    storage to read: they are digested by value, so equal weights give equal tags whatever the CPU."""
    plain = GPT2.from_pretrained(tiny_checkpoint)
    packed = replace_linears(GPT2.from_pretrained(tiny_checkpoint), PackedLinear)
    assert weights_fingerprint(packed) == weights_fingerprint(replace_linears(GPT2.from_pretrained(tiny_checkpoint),
                                                                              PackedLinear))
    assert weights_fingerprint(packed) != weights_fingerprint(plain)  # other names: packed_weight, not weight
