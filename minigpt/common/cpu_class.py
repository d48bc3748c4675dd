"""The x86 CPU class kernels are picked for: torch's capability and the CPU's flags, lowered where a run is forced
to a lower class, so a developer on an AVX-512 machine runs (and measures) the AVX2 paths too.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        minigpt generate ...

`FORCE` names those variables (torch's kernels, oneDNN, fbgemm, MKL) for each class; each library reads them when
it first runs a kernel, so they are set before the process starts (the benches' `--cpu-class` does that)."""

from __future__ import annotations

import functools
import os
import platform

import torch

_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
FORCE = {"avx2": {**_AVX2, "ONEDNN_MAX_CPU_ISA": "AVX2"}, "avx2_vnni": {**_AVX2, "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"}}
NEEDS = {"avx2": "avx2", "avx2_vnni": "avx_vnni"}  # the CPU flag a class forced on it needs
NATIVE_SWITCH = "MINIGPT_NATIVE_KERNELS"  # 0: minigpt's own C++ kernels (kernels/*.cpp) off, torch's everywhere
_SHOWN = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")  # what describe lists


@functools.cache
def x86_flags() -> frozenset[str] | None:
    """This x86 CPU's /proc/cpuinfo flags; None on other CPUs or where unreadable."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next(line for line in cpuinfo if line.startswith("flags"))
    except (OSError, StopIteration):
        return None
    return frozenset(line.partition(":")[2].split())


def unusable(name: str) -> str | None:
    """Why this CPU cannot run class `name` (a key of FORCE) forced on it; None: it can."""
    flags = x86_flags()
    if flags is None:
        return f"the {name} class is an x86 one; this CPU is {platform.machine() or 'unknown'}"
    if NEEDS[name] not in flags:
        return f"this CPU lacks {NEEDS[name]}, which the {name} class needs"
    return None


def native_kernels_on() -> bool:
    return os.environ.get(NATIVE_SWITCH, "1") != "0"


def usable_flags() -> frozenset[str] | None:
    """`x86_flags` less what this run may not use: AVX-512 and AMX where torch runs AVX2 kernels, AVX-VNNI where
    oneDNN is held to plain AVX2."""
    flags = x86_flags()
    if flags is None:
        return None
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"):
        flags = frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in ("AVX2", "AVX", "SSE41"):
        flags = flags - {"avx_vnni"}
    return flags


def describe() -> str:
    """One line for a benchmark's record: the class kernels run at, what forced it, what the CPU has."""
    capability = torch.backends.cpu.get_cpu_capability()
    variables = sorted({name for names in FORCE.values() for name in names})
    forced = [f"{name}={os.environ[name]}" for name in variables if name in os.environ]
    usable, physical = usable_flags(), x86_flags()
    line = capability + (f" ({', '.join(sorted(usable & set(_SHOWN)))})" if usable else "")
    if forced:
        line += f", forced by {' '.join(forced)} on a CPU with {', '.join(f for f in _SHOWN if f in (physical or ()))}"
    return line
