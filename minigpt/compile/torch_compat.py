"""The torch APIs the compiled steps rely on, in one place: `missing_internals()` names any a release moved."""

from __future__ import annotations

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
    import torch._inductor  # not imported by `import torch`

    missing = []
    for name in INTERNALS:
        found = torch
        try:
            for part in name.split(".")[1:]:
                found = getattr(found, part)
        except AttributeError:
            missing.append(name)
    return missing
