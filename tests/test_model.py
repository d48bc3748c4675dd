"""GPT2 against transformers' GPT2LMHeadModel on the same checkpoint files (fp32)."""

from __future__ import annotations

import pytest
import torch

from minigpt.model.gpt2 import ACTIVATIONS, GPT2

from conftest import hf_model, with_residual_outliers

CONFIGS = {
    "default": {},
    "odd-heads": dict(n_head=3, n_embd=48),
    "eps": dict(layer_norm_epsilon=1e-3),
    "gelu": dict(activation_function="gelu"),
    "relu": dict(activation_function="relu"),
    "gelu_fast": dict(activation_function="gelu_fast"),
    "quick_gelu": dict(activation_function="quick_gelu"),
    "silu": dict(activation_function="silu"),
    "gelu_pytorch_tanh": dict(activation_function="gelu_pytorch_tanh"),
    "inverse-layer-idx": dict(scale_attn_by_inverse_layer_idx=True),
    "reorder-upcast": dict(reorder_and_upcast_attn=True),
    "unscaled": dict(scale_attn_weights=False),
    "n_inner": dict(n_inner=96),
    "untied": dict(tie_word_embeddings=False),
    "big-vocab": dict(vocab_size=50304),
    "three-layers-five-heads": dict(n_layer=3, n_head=5, n_embd=80),
}


def _ids(vocab: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("layout", ["hf", "openai"])
def test_logits_match_transformers(checkpoint_factory, name, layout):
    path = checkpoint_factory(layout=layout, **CONFIGS[name])
    ours, ref = GPT2.from_pretrained(path), hf_model(path)
    ids = _ids(ours.config.vocab_size, (2, 37))
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_left_padded_batch_equals_rows_alone(tiny_checkpoint):
    model = GPT2.from_pretrained(tiny_checkpoint)
    lengths = [5, 17, 1, 12]
    T = max(lengths)
    rows = [_ids(model.config.vocab_size, (n,), seed=n) for n in lengths]
    batch = torch.full((len(rows), T), 50256)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, T - len(row):] = row
        mask[i, T - len(row):] = 1
    with torch.no_grad():
        padded = model(batch, attention_mask=mask)
        assert torch.isfinite(padded).all()
        for i, row in enumerate(rows):
            alone = model(row[None])[0]
            torch.testing.assert_close(padded[i, T - len(row):], alone, rtol=1e-5, atol=1e-5)


def test_padded_batch_matches_transformers_with_explicit_positions(tiny_checkpoint):
    """transformers' plain forward uses 0..T-1 unless told: give it the mask-derived positions."""
    ours, ref = GPT2.from_pretrained(tiny_checkpoint), hf_model(tiny_checkpoint)
    ids = _ids(ours.config.vocab_size, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask)
    torch.testing.assert_close(got[0, 4:], expected[0, 4:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)


def test_from_pretrained_is_eval_and_frozen(tiny_checkpoint):
    model = GPT2.from_pretrained(tiny_checkpoint)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.lm_head.weight is model.wte.weight


def test_out_of_range_inputs_are_refused(tiny_checkpoint):
    model = GPT2.from_pretrained(tiny_checkpoint)
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[model.config.vocab_size]]))
    with pytest.raises(ValueError, match="n_positions"):
        model(torch.zeros(1, model.config.n_positions + 1, dtype=torch.long))


@pytest.mark.parametrize(("input_ids", "error", "says"), [
    ([[1, 2]], TypeError, "must be a torch.Tensor"),
    (torch.tensor([[5.0]]), TypeError, "integer token ids, got torch.float32"),
    (torch.tensor([[True]]), TypeError, "integer token ids"),
    (torch.zeros(1, 0, dtype=torch.long), ValueError, r"neither empty, got shape \(1, 0\)"),
    (torch.zeros(0, 3, dtype=torch.long), ValueError, "neither empty"),
    (torch.zeros(3, dtype=torch.long), ValueError, "must be \\(batch, time\\)"),
])
def test_malformed_inputs_are_named(tiny_checkpoint, input_ids, error, says):
    with pytest.raises(error, match=says):
        GPT2.from_pretrained(tiny_checkpoint)(input_ids)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 0.1), (torch.float16, 0.02)])
def test_half_precision_close_to_fp32(tiny_checkpoint, dtype, tol):
    """Stated tolerance: max |logit error| relative to the logit range, bf16 <= 0.1, fp16 <= 0.02."""
    fp32 = GPT2.from_pretrained(tiny_checkpoint)
    half = GPT2.from_pretrained(tiny_checkpoint, dtype=dtype)
    ids = _ids(fp32.config.vocab_size, (2, 20))
    with torch.no_grad():
        ref, got = fp32(ids), half(ids).float()
    assert torch.isfinite(got).all()
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err < tol


def test_fp16_survives_residual_outliers(tmp_path, tiny_checkpoint):
    """GPT-2's residual stream has outlier dimensions that overflow fp16 (max 65504) in engines
    that keep it in half precision (NaN, then a stream of "!"). Here one dimension is pushed past
    that on purpose: the fp32 residual keeps fp16 logits finite and close to fp32."""
    path = with_residual_outliers(tiny_checkpoint, tmp_path / "outliers")
    ids = _ids(50257, (2, 24))
    with torch.no_grad():
        ref = GPT2.from_pretrained(path)(ids)
        got = GPT2.from_pretrained(path, dtype=torch.float16)(ids).float()
        all_half = hf_model(path).half()(ids).logits
    assert not torch.isfinite(all_half).all(), "a half-precision residual overflows on this checkpoint"
    assert torch.isfinite(got).all()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_compiled_tanh_gelu_is_the_same_function():
    """Compiled, `gelu_new` is written with a sigmoid (inductor's tanh is slower): the same function
    as torch's tanh GELU to fp32 rounding, over the activations' range and far past it."""
    gelu = ACTIVATIONS["gelu_new"]
    x = torch.cat([torch.linspace(-12, 12, 20001), torch.tensor([-1e4, -60.0, -1e-30, 0.0, 1e-30, 60.0, 1e4])])
    compiled = torch.compile(gelu, fullgraph=True)(x)
    reference = torch.nn.functional.gelu(x.double(), approximate="tanh")
    assert torch.equal(gelu(x), torch.nn.functional.gelu(x, approximate="tanh"))  # eager: torch's kernel
    assert torch.isfinite(compiled).all()
    assert (compiled.double() - reference).abs().max().item() < 1e-6
