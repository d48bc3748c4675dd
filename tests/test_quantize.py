"""int8 and w8a8: close to fp32 at a stated tolerance, and the engine runs on them."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch._inductor.codecache import PyCodeCache
from torch._inductor.utils import run_and_get_code

from minigpt import LLM, SamplingParams, fbgemm_int8
from minigpt.model import GPT2
from minigpt.quantize import Int8Linear, W8A8Linear, compile_options, quantize, vnni_gemm

from conftest import write_hf_checkpoint

needs_fbgemm = pytest.mark.skipif(not fbgemm_int8.built_in(), reason="torch without fbgemm's quantized ops")
needs_vnni_gemm = pytest.mark.skipif(
    not vnni_gemm(torch.device("cpu")), reason="CPU without AVX-512 VNNI, or torch without inductor's VNNI GEMM"
)

PROMPTS = ["Hello there", "Another prompt, longer than the first one", "x"]


@pytest.mark.parametrize("in_features", [64, 60, 20])
def test_int8_linear_matches_dequantized_weights(in_features):
    """Also for input sizes that are not multiples of 8, where torch's CPU int8 kernel is wrong (or crashes)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, 96)
    q = Int8Linear(linear)
    x = torch.randn(5, in_features)
    dequantized = q.weight.float() * q.scales.float()[:, None]
    assert (dequantized - linear.weight).abs().max() <= q.scales.max() / 2 + 1e-7  # rounding error bound
    expected = x @ dequantized.t() + linear.bias
    torch.testing.assert_close(q(x), expected, rtol=2e-2, atol=2e-2)  # activations pass through bf16


@pytest.mark.parametrize("mode", ["int8", "w8a8"])
def test_quantized_model_logits_close_to_fp32(tiny_checkpoint, mode):
    """Stated tolerance: max |logit error| <= 5% of the logit range; top-1 agrees on >= 90% of positions."""
    fp32 = GPT2.from_pretrained(tiny_checkpoint)
    quantized = quantize(GPT2.from_pretrained(tiny_checkpoint), mode)
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.modules())
    ids = torch.randint(0, 50257, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = fp32(ids), quantized(ids)
    assert (got - ref).abs().max() / ref.abs().max() < 0.05
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_engine_with_int8(tiny_checkpoint):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(str(tiny_checkpoint), quantize="int8") as llm:
        outs = llm.generate(["Hello there", "Another prompt, longer than the first one"], params)
        alone = llm.generate(["Hello there"], params)[0]
    assert [len(o.token_ids) for o in outs] == [8, 8]
    assert alone.token_ids == outs[0].token_ids


@pytest.fixture(params=["int_mm", pytest.param("fbgemm", marks=needs_fbgemm)])
def w8a8_kernel(request, monkeypatch):
    """Each int8 x int8 kernel W8A8Linear can pick, whatever this CPU would pick."""
    monkeypatch.setattr(fbgemm_int8, "available", lambda device: request.param == "fbgemm")
    return request.param


def test_w8a8_linear_is_per_row_and_close(w8a8_kernel):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    q = W8A8Linear(linear)
    assert q.fbgemm == (w8a8_kernel == "fbgemm")
    x = torch.randn(6, 64)
    x[3] *= 100  # one row with a far larger range must not change the others' results
    batched = q(x)
    for i in range(6):
        torch.testing.assert_close(q(x[i : i + 1])[0], batched[i])
    torch.testing.assert_close(batched, linear(x), rtol=0.05, atol=0.05 * linear(x).abs().max().item())


@needs_fbgemm
def test_fbgemm_int8_mm_is_exact():
    """7-bit activations times int8 weights: the exact integer products, also where full-range
    activations would saturate AVX2's 16-bit pair sums (all at the extremes here)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (96, 256), dtype=torch.int8, generator=generator)
    weight[:8] = 127
    x = torch.randint(-63, 64, (5, 256), generator=generator).float()
    x[0] = 63
    fbgemm_int8.pack(weight)
    want = x.double() @ weight.double().t()
    assert torch.equal(fbgemm_int8.int8_mm(x, weight).double(), want)


@needs_fbgemm
def test_fbgemm_packing_lives_with_its_weight():
    weight = torch.ones(8, 16, dtype=torch.int8)
    fbgemm_int8.pack(weight)
    key = weight.data_ptr()
    assert key in fbgemm_int8._PACKED
    del weight
    gc.collect()
    assert key not in fbgemm_int8._PACKED
    with pytest.raises(RuntimeError, match="not packed"):
        fbgemm_int8.int8_mm(torch.ones(1, 16), torch.ones(8, 16, dtype=torch.int8))


def test_engine_with_w8a8_is_batch_invariant(tiny_checkpoint):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(str(tiny_checkpoint), quantize="w8a8") as llm:
        batched = [o.token_ids for o in llm.generate(PROMPTS, params)]
        alone = [llm.generate([p], params)[0].token_ids for p in PROMPTS]
    assert batched == alone


def test_unknown_quantization():
    with pytest.raises(ValueError, match="quantize"):
        quantize(torch.nn.Sequential(torch.nn.Linear(2, 2)), "int4")


def _inductor_modules() -> list:
    """The Python modules of every graph inductor has loaded in this process, oldest first."""
    return list(PyCodeCache.modules)


def _graph_constants(before: list) -> list[weakref.ref]:
    """Weak references to the tensors held as attributes by the modules inductor loaded since `before`
    was taken: a frozen graph's constants (its packed copies of the weights)."""
    new = [m for m in _inductor_modules() if not any(m is old for old in before)]
    return [weakref.ref(v) for m in new for v in vars(m).values() if isinstance(v, torch.Tensor)]


def _pattern_matches() -> int:
    """Products inductor's freezing pass has matched as int8 quantization patterns so far, in this
    process: each then runs an int8 kernel (inductor's GEMM or oneDNN's qlinear), none dequantizes its
    weight."""
    return torch._dynamo.utils.counters["inductor"]["qlinear_weight_prepack_matcher_count"]


@pytest.mark.slow
@needs_vnni_gemm
@pytest.mark.parametrize("out_features", [96, 200])  # 200: not a multiple of the kernel's 64 columns
def test_w8a8_vnni_gemm_equals_int_mm(out_features):
    """Frozen and compiled, W8A8Linear's product goes through inductor's int8 GEMM, and gives what eager
    (torch._int_mm) gives, bit for bit: the same integer products (exact while the sums of the shifted
    activations' products stay under 2^24, as here), scaled in the same order. Offered
    only its own GEMM, inductor falls back to oneDNN's qlinear when its kernel cannot take the pattern
    (weight scales or zero points that are not constants: slower than torch._int_mm at batch 1)."""
    torch.manual_seed(0)
    q = W8A8Linear(torch.nn.Linear(64, out_features))
    x = torch.randn(5, 64)
    x[3] *= 100
    compiled = torch.compile(q)
    options = {**compile_options("w8a8", torch.device("cpu")), "max_autotune_gemm_backends": "CPP"}
    matched = _pattern_matches()
    with torch.no_grad(), torch._inductor.config.patch(options):
        got, code = run_and_get_code(compiled, x)
    assert _pattern_matches() == matched + 1
    assert "qlinear_pointwise" not in "".join(code)
    with torch.no_grad():
        assert torch.equal(got, q(x))


@pytest.mark.slow
def test_compiled_w8a8_engine_equals_eager(tiny_checkpoint):
    """The compiled graphs run the same int8 x int8 products as eager: the same tokens, batched and alone.
    Where inductor has its VNNI GEMM, every product of the three frozen graphs (decode at batch 1 and
    >= 2, a lone prompt) matches the quantization pattern, and the frozen weights go at close();
    the block halves around a batched step's attention compile unfrozen, with torch._int_mm."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM(str(tiny_checkpoint), quantize="w8a8") as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, params)]
        linears = sum(isinstance(m, W8A8Linear) for m in llm.engine.runner.model.modules())
    matched, modules = _pattern_matches(), _inductor_modules()
    with LLM(str(tiny_checkpoint), quantize="w8a8", compile=True) as llm:
        frozen = vnni_gemm(torch.device("cpu"))
        assert _pattern_matches() - matched == (3 * linears if frozen else 0)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
        assert [llm.generate([p], params)[0].token_ids for p in PROMPTS] == want
        weight = weakref.ref(llm.engine.runner.model.h[0].mlp.c_fc.weight)
        constants = _graph_constants(modules)
        model = llm.engine.runner.model
        own = {id(tensor) for tensor in [*model.parameters(), *model.buffers()]}
    del model
    gc.collect()
    assert bool(constants) == frozen
    # close() frees the frozen graphs' own constants (inductor keeps none); the rest are the model's tensors
    assert all(constant() is None or id(constant()) in own for constant in constants)
    del llm
    gc.collect()
    assert weight() is None
    assert all(constant() is None for constant in constants)


def _assert_eager_would_pick_about_the_same(model: GPT2, outs: list) -> None:
    """Teacher-forced through the eager model, every token of `outs` has a logit within 1% of the logit
    range of the eager maximum."""
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids + out.token_ids])
        with torch.inference_mode():
            logits = model(ids)[0, len(out.prompt_token_ids) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        gap = (logits.amax(1) - chosen) / (logits.amax(1) - logits.amin(1))
        assert gap.max() <= 0.01


@pytest.mark.slow
def test_compiled_int8_engines_of_one_shape_each_run_their_own_weights(tmp_path):
    """torch caches frozen graphs on disk under a key that holds the weights' shapes, not their values,
    though the graph holds packed copies of them (pytorch#143563): two checkpoints of one shape compiled
    one after the other (gpt2, then a fine-tune of it) must each run on their own weights."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for seed in (11, 12):
        path = write_hf_checkpoint(tmp_path / f"seed{seed}", seed=seed)
        with LLM(str(path), quantize="int8", compile=True) as llm:
            outs = llm.generate(PROMPTS, params) + [llm.generate([p], params)[0] for p in PROMPTS]
            _assert_eager_would_pick_about_the_same(llm.engine.runner.model, outs)


@pytest.mark.slow
def test_compiled_int8_engine_is_greedy_within_tolerance(tiny_checkpoint):
    """compile=True with int8 freezes the weights and may run inductor's own int8 x bf16 kernel, which
    rounds differently from torch's: tokens can part from eager's where two logits nearly tie.
    Stated tolerance: teacher-forced through the eager int8 model, every token the compiled engine
    picks (batched and alone) has a logit within 1% of the logit range of the eager maximum. The frozen
    graphs hold the weights, so they must go with the engine, and inductor must not keep them after it."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    modules = _inductor_modules()
    with LLM(str(tiny_checkpoint), quantize="int8", compile=True) as llm:
        constants = _graph_constants(modules)
        outs = llm.generate(PROMPTS, params) + [llm.generate([p], params)[0] for p in PROMPTS]
        model = llm.engine.runner.model
        _assert_eager_would_pick_about_the_same(model, outs)
        weight = weakref.ref(model.h[0].mlp.c_fc.weight)
    del llm, model
    gc.collect()
    assert weight() is None  # the frozen graphs held the int8 weights as constants: gone with the engine
    assert constants and all(constant() is None for constant in constants)  # inductor's modules let them go
