"""int8 and w8a8: close to fp32 at a stated tolerance, and the engine runs on them."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from minigpt import LLM, SamplingParams
from minigpt.model import GPT2
from minigpt.quant import fbgemm_int8
from minigpt.quant.quantize import ONE_ROW_MAX_INPUTS, Int8Linear, W8A8Linear, one_row_products, quantize, round_to_int8

from conftest import write_hf_checkpoint

needs_fbgemm = pytest.mark.skipif(not fbgemm_int8.built_in(), reason="torch without fbgemm's quantized ops")

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


@pytest.mark.parametrize("in_features", [64, 768, 1040, 1600, 3072, 6400, 1031])
def test_one_row_products_are_the_exact_integer_products(in_features):
    """Near the extremes (sums far past 2**24, where a plain fp32 sum rounds: rows 0 and 1 against the
    row of 127s) and on random int8 values, for sizes of one piece, of several, and prime:
    torch._int_mm's integers as fp32 (what W8A8Linear makes of them), exactly."""
    torch.manual_seed(in_features)
    weight = torch.randint(-127, 128, (24, in_features), dtype=torch.int8)
    weight[0], weight[1] = 127, torch.randint(100, 128, (in_features,), dtype=torch.int8)
    rows = [torch.full((1, in_features), 127.0), torch.randint(-127, 128, (1, in_features)).float()]
    for row in rows:
        want = torch._int_mm(row.to(torch.int8), weight.t())
        got = one_row_products(row, weight)
        assert torch.equal(got, want.float())
    assert int(one_row_products(rows[0], weight)[0, 0]) == 127 * 127 * in_features  # even: fp32 holds it


def test_one_row_products_only_up_to_their_width(monkeypatch):
    """A compiled program of one row reduces weights of up to ONE_ROW_MAX_INPUTS inputs (faster there),
    and multiplies wider ones with torch._int_mm (faster for gpt2-xl's 6400); where fbgemm runs (AVX2), it
    multiplies every row."""
    monkeypatch.setattr(fbgemm_int8, "available", lambda device: False)
    assert W8A8Linear(torch.nn.Linear(ONE_ROW_MAX_INPUTS, 8)).reduce_one_row
    assert not W8A8Linear(torch.nn.Linear(6400, 8)).reduce_one_row
    monkeypatch.setattr(fbgemm_int8, "available", lambda device: True)
    monkeypatch.setattr(fbgemm_int8, "pack", lambda weight: None)
    assert not W8A8Linear(torch.nn.Linear(ONE_ROW_MAX_INPUTS, 8)).reduce_one_row


def test_round_to_int8_rounds_each_row_whatever_the_chunks():
    """Rows rounded a chunk at a time, the last chunk short: the same int8 as the whole weight at once,
    each row to its own absmax / 127 (a zero row to zeros)."""
    torch.manual_seed(0)
    weight = torch.randn(300, 64) * torch.rand(300, 1)
    weight[7] = 0
    low, high = torch.aminmax(weight, dim=1)
    scales = torch.maximum(high, -low).clamp(min=1e-12) / 127.0
    want = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    for rows in (1, 64, 256, 300, 1000):
        rounded, got_scales = round_to_int8(weight, rows)
        assert torch.equal(rounded, want) and torch.equal(got_scales, scales)
    assert rounded[7].eq(0).all() and rounded.abs().amax(1)[torch.arange(300) != 7].eq(127).all()


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


@pytest.mark.slow
def test_compiled_w8a8_engine_equals_eager(tiny_checkpoint):
    """The compiled programs run the same int8 x int8 products as eager, over the model's own int8
    weights: the same tokens, batched and alone (through the programs of one sequence, whose products
    are `one_row_products`); nothing holds the weights after the engine goes."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM(str(tiny_checkpoint), quantize="w8a8") as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(str(tiny_checkpoint), quantize="w8a8", compile=True) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
        calls = []

        def counted(program, name):
            return lambda *inputs: calls.append(name) or program(*inputs)

        compiled = llm.engine.runner.forward_path
        compiled.alone = tuple(map(counted, compiled.alone, ("layer", "head")))
        del compiled
        assert [llm.generate([p], params)[0].token_ids for p in PROMPTS] == want
        n_layer = llm.engine.runner.model.config.n_layer
        decodes = len(PROMPTS) * (params.max_tokens - 1)  # every decode step alone
        assert calls.count("layer") == n_layer * decodes
        assert calls.count("head") == decodes + len(PROMPTS)  # and each prompt's logits row
        weight = weakref.ref(llm.engine.runner.model.h[0].mlp.c_fc.weight)
    del llm
    gc.collect()
    assert weight() is None


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
    """Two checkpoints of one shape (gpt2, then a fine-tune of it) share one entry of compiled programs,
    and each runs on its own weights. Tolerance: teacher-forced through the eager int8 model, every
    token the compiled engine picks (batched and alone) has a logit within 1% of the logit range of the
    eager maximum (the compiled programs fuse the elementwise work around the same int8 products)."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for seed in (11, 12):
        path = write_hf_checkpoint(tmp_path / f"seed{seed}", seed=seed)
        with LLM(str(path), quantize="int8", compile=True) as llm:
            outs = llm.generate(PROMPTS, params) + [llm.generate([p], params)[0] for p in PROMPTS]
            _assert_eager_would_pick_about_the_same(llm.engine.runner.model, outs)
