"""The torch internals the compiled steps use (minigpt/compile/torch_compat.py): a torch release that moves one
fails here, naming it, before any compiled engine misbehaves."""

import pytest

from minigpt import LLM
from minigpt.compile import torch_compat


def test_this_torch_has_every_internal_used():
    missing = torch_compat.missing_internals()
    assert not missing, f"torch moved internals minigpt's compiled steps use: {', '.join(missing)}"


def test_a_moved_internal_is_named(monkeypatch):
    moved = (*torch_compat.INTERNALS, "torch._inductor.config.no_such")
    monkeypatch.setattr("minigpt.compile.torch_compat.INTERNALS", moved)
    assert torch_compat.missing_internals() == ["torch._inductor.config.no_such"]


def test_compile_refuses_to_start_without_them(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr("minigpt.compile.torch_compat.INTERNALS", ("torch._dynamo.no_such_function",))
    with pytest.raises(RuntimeError, match=r"compile=True needs torch internals .* lacks: torch._dynamo.no_such_"):
        LLM(str(tiny_checkpoint), compile=True)
