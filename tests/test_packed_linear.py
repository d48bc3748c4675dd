"""bf16 linears on oneDNN-packed weights: the same products as nn.Linear, eager and compiled, and
the bf16 CPU engine uses them for every linear."""

from __future__ import annotations

import pytest
import torch

from minigpt import LLM, SamplingParams
from minigpt.packed_linear import PackedLinear, can_pack

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, CPU), reason="this CPU's oneDNN has no bf16")

# Both sides accumulate in fp32 and round once to bf16: they may differ by that last rounding.
BF16_ROUNDING = dict(rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (2, 3, 64)])
def test_packed_linear_equals_linear(shape, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(shape, dtype=torch.bfloat16)
    got = PackedLinear(linear)(x)
    assert got.shape == (*shape[:-1], 96) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, linear(x), **BF16_ROUNDING)


def test_packed_linear_compiles_as_one_call():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96).to(torch.bfloat16)
    packed = PackedLinear(linear)

    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(packed(x.to(torch.bfloat16)).float() * 2)

    targets = []

    def inspecting_backend(graph_module, example_inputs):
        targets.extend(node.target for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    x = torch.randn(4, 64)
    with torch.inference_mode():
        torch.testing.assert_close(torch.compile(block, fullgraph=True)(x), block(x))
        torch.compile(block, backend=inspecting_backend, fullgraph=True)(x)
    assert targets.count(torch.ops.minigpt.packed_linear.default) == 1


def test_bf16_engine_packs_every_linear_and_fp32_none(tiny_checkpoint):
    prompt = [[5, 6, 7, 8]]
    for dtype, packs in (("bfloat16", True), ("float32", False)):
        with LLM(str(tiny_checkpoint), dtype=dtype) as llm:
            modules = list(llm.engine.model.modules())
            assert any(isinstance(m, PackedLinear) for m in modules) == packs
            assert any(isinstance(m, torch.nn.Linear) for m in modules) != packs
            assert len(llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4
