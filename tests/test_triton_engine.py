"""GPU paths as far as a CPU can prove them: the engine on the Triton backend, the backend switch, and
the decode step's host-device syncs.

This process never imports triton (see test_kernels.py), so everything that depends on triton's import
state runs in a fresh child process: the engine under Triton's interpreter (``triton_engine_case.py``),
an unavailable or interpreter-less Triton, and the CPU default path that must not import triton at all.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import minigpt.common.transfer
import minigpt.engine.engine
import minigpt.engine.runner
from minigpt import LLM, SamplingParams

from conftest import needs_cuda

HERE = Path(__file__).parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def run_child(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = env if env is not None else {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], cwd=HERE.parent, env=env, capture_output=True, text=True)


def run_python(code: str) -> subprocess.CompletedProcess:
    return run_child(["-c", textwrap.dedent(code)])


@pytest.mark.triton
@needs_triton
def test_engine_on_triton_backend_gives_torch_backend_tokens() -> None:
    """``triton_engine_case.py`` in a fresh process: greedy tokens through the Triton kernels (under the
    interpreter without a GPU) equal the torch backend's in fp32 and fp16, and in bf16 up to a near-tie."""
    result = run_child(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "triton_engine_case.py")])
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]


def test_triton_backend_without_triton_is_a_clear_error(tiny_checkpoint) -> None:
    result = run_python(f"""
        import sys
        sys.modules["triton"] = None  # import triton now raises ImportError, as when it is not installed
        from minigpt import LLM
        try:
            LLM({str(tiny_checkpoint)!r}, attention_backend="triton")
        except ValueError as err:
            print(err)
    """)
    assert result.returncode == 0, result.stderr
    assert "attention_backend='triton' is unavailable" in result.stdout
    assert "pip install 'minigpt[triton]'" in result.stdout


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the compiled kernels run")
def test_triton_backend_on_cpu_without_the_interpreter_is_a_clear_error(tiny_checkpoint) -> None:
    """Compiled Triton kernels cannot launch on the CPU ("0 active drivers" at the first step): refuse
    at construction instead."""
    result = run_python(f"""
        from minigpt import LLM
        try:
            LLM({str(tiny_checkpoint)!r}, attention_backend="triton")
        except ValueError as err:
            print(err)
    """)
    assert result.returncode == 0, result.stderr
    assert "runs only under Triton's interpreter" in result.stdout and "TRITON_INTERPRET=1" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks Triton on CUDA")
def test_cpu_default_path_never_imports_triton(tiny_checkpoint) -> None:
    result = run_python(f"""
        import sys
        from minigpt import LLM, SamplingParams
        with LLM({str(tiny_checkpoint)!r}) as llm:
            assert llm.engine.runner.backend.name == "torch", llm.engine.runner.backend.name
            llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=4))
        assert "triton" not in sys.modules, "the CPU default path imported triton"
    """)
    assert result.returncode == 0, result.stderr


# -- host-device syncs of a step ----------------------------------------------------------------------

# aten ops that make the host wait for a CUDA device: reading a value (item, bool(), int()) and shapes
# that depend on data (nonzero, boolean masks).
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
            "aten.is_nonzero.default", "aten.equal.default", "aten.unique_consecutive.default"}


class StepOps(TorchDispatchMode):
    """Counts the aten ops run inside the mode, boolean-mask indexing under its own name, and the ops run
    while ``copying`` is non-empty (inside ``to_device``) not at all."""

    def __init__(self, copying: list | None = None) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.copying = [] if copying is None else copying

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name == "aten.index.Tensor" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            name = "boolean-mask index"
        if not self.copying:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _started_engine(path: Path, device: str = "cpu") -> minigpt.engine.engine.Engine:
    """An engine with two sequences past their prefill, so the next step decodes both; steps not overlapped,
    each reading its own tokens."""
    engine = LLM(str(path), device=device, block_size=8, overlap="off").engine
    for prompt in ([1, 2, 3, 4, 5], list(range(20))):
        engine.add(engine.make_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    engine.step()
    return engine


def test_step_reads_only_the_sampled_tokens_from_the_device(tiny_checkpoint, monkeypatch) -> None:
    """A CPU stand-in for CUDA's sync debug mode. In a decode step, and in a step mixing a prefill with
    decodes, no op makes the host wait for the device; the one device-to-host read is the sampler's
    ``tolist`` of the tokens; and every tensor built from host values (``lift_fresh``: on CUDA a copy to
    the device) comes from ``to_device``, which copies from pinned memory without blocking on CUDA."""
    engine = _started_engine(tiny_checkpoint)
    host_copies, reads, copying = [], [], []
    to_device = minigpt.common.transfer.to_device

    def counted_copy(*args):
        host_copies.append(args)
        copying.append(args)
        try:
            return to_device(*args)
        finally:
            copying.pop()

    for module in (minigpt.engine.engine, minigpt.engine.runner):  # every module of the step that builds tensors
        monkeypatch.setattr(module, "to_device", counted_copy)
    tolist = torch.Tensor.tolist
    for new_prompt in (None, [7, 8, 9, 10]):  # decode only; then a prefill joins the decodes
        if new_prompt is not None:
            engine.add(engine.make_request(new_prompt, SamplingParams(max_tokens=2, ignore_eos=True)))
        host_copies.clear()
        reads.clear()
        counted_tolist = mock.patch.object(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
        with StepOps(copying) as mode, counted_tolist:
            sampled = engine.step()
        syncs = {op: n for op, n in mode.ops.items() if op in SYNC_OPS or op == "boolean-mask index"}
        assert not syncs, syncs
        assert reads == [torch.Size([len(sampled)])]
        assert "aten.lift_fresh.default" not in mode.ops and host_copies


@pytest.mark.cuda
@needs_cuda
def test_cuda_decode_step_syncs_only_to_read_the_tokens(tiny_checkpoint) -> None:
    """The same on a GPU with CUDA's sync debug mode: one synchronizing call per decode step (a CUDA
    graph's replay), the sampled tokens' ``tolist``."""
    engine = _started_engine(tiny_checkpoint, "cuda")
    engine.step()  # warm up the decode path
    torch.cuda.synchronize()
    with pytest.warns(UserWarning) as caught:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
