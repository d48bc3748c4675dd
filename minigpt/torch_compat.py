"""The torch internals the compiled steps rely on, all in one place.

Each engine compiles private copies of the step functions (dynamo keeps its graphs per code object)
and frees them when it closes: dynamo's graphs for those code objects, and the modules inductor loaded
for them that hold the graphs' constants (packed copies of the weights, which inductor would keep
until the process ends). Frozen graphs need inductor's global `freezing` set while dynamo traces, and
a disk-cache key tag naming the weights, since inductor keys a frozen graph by the weights' shapes only.
`missing_internals()` names whatever a torch release moved; tests/test_torch_compat.py fails on it.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch

# Every torch internal this module uses; each of them has moved in some torch release.
INTERNALS = (
    "torch._C._dynamo.eval_frame.reset_code",
    "torch._inductor.codecache.PyCodeCache.modules",
    "torch._inductor.codecache.PyCodeCache.modules_no_attr",
    "torch._inductor.config.freezing",
    "torch.compiler.config.cache_key_tag",
    "torch.compiler.skip_guard_on_all_nn_modules_unsafe",
    "torch._dynamo.mark_dynamic",
)


def missing_internals() -> list[str]:
    """The names of `INTERNALS` this torch lacks (none on the releases minigpt has been run on)."""
    import torch._inductor.codecache  # noqa: F401  (not imported by `import torch`)

    missing = []
    for name in INTERNALS:
        found = torch
        try:
            for part in name.split(".")[1:]:
                found = getattr(found, part)
        except AttributeError:
            missing.append(name)
    return missing


def private_copy(fn: types.FunctionType) -> types.FunctionType:
    """`fn` with a code object of its own, so that its compiled graphs are this engine's alone."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def guard_options() -> dict[str, object]:
    """torch.compile options that skip the guards on nn.Modules: each compiled copy only ever sees one
    model. A dict for each call: torch.compile pops `guard_filter_fn` from the one it is given."""
    return {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


class CompiledCode:
    """What one engine's compiled copies own: their code objects, and the inductor modules their
    compiles loaded. `compiling()` wraps every call (a call may compile); `drop()` frees it all."""

    def __init__(self, functions: list[types.FunctionType], freezing: bool, cache_key_tag: str) -> None:
        from torch._inductor.codecache import PyCodeCache

        self.codes = tuple(fn.__code__ for fn in functions)
        self.modules: list[types.ModuleType] = []
        self._loaded = PyCodeCache.modules  # inductor's list of every module it loaded, kept in place
        # dynamo reads `freezing` from the global config while it traces: set around each call
        self._config = (
            torch._inductor.config.patch(freezing=freezing),
            torch.compiler.config.patch(cache_key_tag=torch.compiler.config.cache_key_tag + cache_key_tag),
        )

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        count = len(self._loaded)
        with self._config[0], self._config[1]:
            try:
                yield
            finally:
                self.modules.extend(self._loaded[count:])  # a call that compiled: its modules are this engine's

    def drop(self) -> None:
        drop_compiled(self.codes, self.modules)


def drop_compiled(codes: tuple[types.CodeType, ...], modules: list[types.ModuleType]) -> None:
    """Free dynamo's graphs for these code objects, and the inductor modules loaded for them that hold
    constants. Modules without constants (`modules_no_attr`) are inductor's to share."""
    from torch._inductor.codecache import PyCodeCache

    for code in codes:
        torch._C._dynamo.eval_frame.reset_code(code)
    shared = {id(module) for module in PyCodeCache.modules_no_attr.values()}
    for module in modules:
        if id(module) in shared:
            continue
        with contextlib.suppress(ValueError):
            PyCodeCache.modules.remove(module)
        if sys.modules.get(module.__name__) is module:
            del sys.modules[module.__name__]
    modules.clear()


def mark_dynamic(*tensors: torch.Tensor, dim: int) -> None:
    for tensor in tensors:
        torch._dynamo.mark_dynamic(tensor, dim)

