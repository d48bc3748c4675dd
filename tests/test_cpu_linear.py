"""CPU linears (minigpt/model/linears.py): the same products as nn.Linear, eager and compiled, and the
engine uses the one `cpu_linear_for` picks for every linear."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from minigpt import LLM, SamplingParams
from minigpt.model import linears as cpu_linear
from minigpt.model.linears import SMALL_BATCH, HalfWeightLinear, PackedLinear, cpu_linear_for, native_bf16

CPU = torch.device("cpu")
needs_bf16 = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU's oneDNN has no bf16"
)
# bf16 results are rounded once from fp32 sums: two kernels may differ by that last rounding.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}
SHAPES = [(1, 64), (5, 64), (2, 3, 64), (SMALL_BATCH + 1, 64), (4, 7, 64)]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_packed_linear_equals_linear(shape, bias, dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=bias).to(dtype)
    x = torch.randn(shape, dtype=dtype)
    got = PackedLinear(linear)(x)
    assert got.shape == (*shape[:-1], 96) and got.dtype == dtype
    torch.testing.assert_close(got, linear(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_weight_linear_equals_linear(shape, bias, dtype, monkeypatch):
    """Small batches through the half kernel, larger ones upcast a few weight rows at a time (rows
    shrunk here so the 96 outputs take several chunks)."""
    monkeypatch.setattr("minigpt.model.linears.UPCAST_ROWS", 40)
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=bias).to(dtype)
    x = torch.randn(shape, dtype=dtype)
    got = HalfWeightLinear(linear)(x)
    assert got.shape == (*shape[:-1], 96) and got.dtype == dtype
    want = linear.float()(x.float())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind", [PackedLinear, HalfWeightLinear])
def test_cpu_linears_export_as_one_call(kind):
    """The compiled steps are exported: each linear is one call of its op, over tensors export can take
    (a packed weight's handle, not the opaque packed weight)."""
    torch.manual_seed(0)
    dtype = torch.float32 if kind is PackedLinear else torch.bfloat16
    op = {PackedLinear: torch.ops.minigpt.packed_linear, HalfWeightLinear: torch.ops.minigpt.half_weight_linear}[kind]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = kind(torch.nn.Linear(64, 96).to(dtype))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.gelu(self.linear(x.to(dtype)).float() * 2)

    block, x = Block(), torch.randn(SMALL_BATCH + 4, 64)
    batch = torch.export.Dim("batch", min=1)
    with torch.inference_mode():
        exported = torch.export.export(block, (x,), dynamic_shapes=({0: batch},))
        targets = [node.target for node in exported.graph.nodes if node.op == "call_function"]
        assert targets.count(op.default) == 1
        for rows in (1, SMALL_BATCH + 4):
            torch.testing.assert_close(exported.module()(x[:rows]), block(x[:rows]))


def test_cpu_linear_choice_follows_the_cpu():
    capability = torch.backends.cpu.get_cpu_capability()
    assert cpu_linear_for(torch.float32, CPU) is (PackedLinear if capability == "AVX2" else None)
    assert cpu_linear_for(torch.bfloat16, CPU) is (PackedLinear if native_bf16() else HalfWeightLinear)
    assert cpu_linear_for(torch.float32, torch.device("meta")) is None


AVX512_VNNI = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})


@pytest.mark.parametrize(
    "onednn_bf16, flags, native",
    [
        (True, AVX512_VNNI, False),  # oneDNN runs bf16 on any AVX-512 CPU, emulated without avx512_bf16
        (True, AVX512_VNNI | {"avx512_bf16"}, True),
        (True, AVX512_VNNI | {"amx_bf16"}, True),
        (True, None, True),  # flags unreadable (or not x86): oneDNN's word
        (False, AVX512_VNNI | {"avx512_bf16"}, False),
    ],
)
def test_native_bf16_needs_bf16_arithmetic_not_just_onednn(monkeypatch, onednn_bf16, flags, native):
    monkeypatch.setattr(cpu_linear, "usable_flags", lambda: flags)
    native_bf16.cache_clear()
    try:
        with mock.patch.object(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_bf16):
            assert native_bf16() is native
            assert cpu_linear_for(torch.bfloat16, CPU) is (PackedLinear if native else HalfWeightLinear)
    finally:
        native_bf16.cache_clear()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_uses_the_chosen_linear_everywhere(tiny_checkpoint, dtype):
    kind = cpu_linear_for(getattr(torch, dtype), CPU)
    with LLM(str(tiny_checkpoint), dtype=dtype) as llm:
        modules = list(llm.engine.runner.model.modules())
        assert any(isinstance(m, torch.nn.Linear) for m in modules) == (kind is None)
        if kind is not None:
            assert sum(isinstance(m, kind) for m in modules) == 4 * len(llm.engine.runner.model.h) + 1
        assert len(llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4
