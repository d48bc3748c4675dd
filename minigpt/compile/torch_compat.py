"""The torch APIs the compiled steps rely on, all in one place.

The compiled steps are `torch.export`ed, with the model's tensors as inputs, and compiled by
AOTInductor into packages loaded from disk, all of it newer than torch's stable core.
`missing_internals()` names whatever a torch release moved; tests/test_torch_compat.py fails on it.
"""

from __future__ import annotations

# Every torch API the compiled steps use that has moved or appeared in a recent release.
INTERNALS = (
    "torch.export.export",
    "torch.export.Dim",
    "torch.func.functional_call",
    "torch._inductor.aoti_compile_and_package",
    "torch._inductor.aoti_load_package",
    "torch._C._aoti.AOTIModelPackageLoader.boxed_run",  # a loaded package's `.loader`, called with flat inputs
    "torch._C._aoti.AOTIModelPackageLoader.get_call_spec",
    "torch.fx.experimental.symbolic_shapes.statically_known_true",  # one-row products in programs of one row
)


def missing_internals() -> list[str]:
    """The names of `INTERNALS` this torch lacks (none on the releases minigpt has been run on)."""
    import torch._inductor  # (not imported by `import torch`)

    missing = []
    for name in INTERNALS:
        found = torch
        try:
            for part in name.split(".")[1:]:
                found = getattr(found, part)
        except AttributeError:
            missing.append(name)
    return missing
