"""int8 products of a few rows on x86 CPUs with AVX2: the kernel of kernels/int8_rows_avx2.cpp, over a weight
packed 4 outputs x 32 inputs a block so that a product reads it in order, 2 or 4 streams a thread (the fastest
setting here, timed once a process: `tuned`), where fbgemm's products of one row (AVX2 class) and oneDNN's or
inductor's (AVX-512 class) read it slower (scripts/PERFORMANCE.md, "The AVX2 int8 kernel"). The kernel's products
are exact integers, theirs too: the same bits whichever of them a row goes through, in any setting.

Used where `usable(in_features)`, at every x86 class with AVX2; `MINIGPT_NATIVE_KERNELS=0`
(`cpu_class.NATIVE_SWITCH`) turns it off (fbgemm's, oneDNN's or inductor's products then take every row)."""

from __future__ import annotations

import functools
import logging
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minigpt import kernels
from minigpt.common.cpu_class import native_kernels_on, usable_flags

logger = logging.getLogger("minigpt")

ROWS = 4  # rows up to which the kernel beats fbgemm's product
INT_MM_ROWS = 8  # rows up to which it beats oneDNN's `torch._int_mm` (the AVX-512 class)
OUTPUTS, INPUTS = 4, 32  # a packed block (as in the kernel)
SOURCE = Path(kernels.__file__).parent / "int8_rows_avx2.cpp"
FLAGS = ("-mavx2", "-mfma")
STREAMS = (2, 4)  # the kernel's settings, streams a thread reads side by side; the first its default
TIMED_WEIGHTS, TIMED_OUTPUTS, TIMED_INPUTS = 24, 3072, 768  # what `tune` reads: 57 MB, past most L3 caches
TIMED_ROUNDS = 5


def usable(in_features: int) -> bool:
    """The kernel runs here, for a weight of `in_features` inputs: the CPU has AVX2 (whatever class torch's
    kernels are), the switch is not off, and the library built and loaded (once a process)."""
    if not (in_features % INPUTS == 0 and "avx2" in (usable_flags() or ()) and native_kernels_on() and loaded()):
        return False
    tuned()  # once a process, before its first product
    return True


@functools.cache
def loaded() -> bool:
    from minigpt.compile.native import loads

    return loads(SOURCE, FLAGS, "fbgemm or _int_mm for every row", {"minigpt_cpu::int8_rows_mm": _rows_mm_shape,
                 "minigpt_cpu::int8_rows_or_int_mm": _rows_or_int_mm_shape})


@functools.cache
def tuned() -> int:
    """`tune` once a process, where the kernel is first used: the streams it set."""
    streams = tune()
    logger.info("int8 kernel: %d streams a thread", streams)
    return streams


def tune(rounds: int = TIMED_ROUNDS) -> int:
    """Time one row's products over `TIMED_WEIGHTS` weights of gpt2's MLP shape with each of `STREAMS`,
    alternated over `rounds`; set the kernel to the one of least median time and return it. The settings differ
    in speed only, never in bits."""
    weights = [torch.ones(TIMED_OUTPUTS // OUTPUTS, TIMED_INPUTS // INPUTS, OUTPUTS, INPUTS, dtype=torch.int8)
               for _ in range(TIMED_WEIGHTS)]  # packed as `pack` packs: the values do not change the time
    x = torch.ones(1, TIMED_INPUTS, dtype=torch.int8)
    times: dict[int, list[float]] = {streams: [] for streams in STREAMS}
    for _ in range(rounds):
        for streams in STREAMS:
            configure(streams)
            start = time.perf_counter()
            for weight in weights:
                rows_mm(x, weight, TIMED_OUTPUTS)
            times[streams].append(time.perf_counter() - start)
    fastest = min(STREAMS, key=lambda streams: statistics.median(times[streams]))
    configure(fastest)
    return fastest


def configure(streams: int) -> None:
    """The kernel's streams a thread for this process (one of `STREAMS`); the products' integers are the same."""
    _kernel_ops().int8_rows_configure(streams)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [ceil(N / 4), K / 32, 4, 32], outputs past N zero."""
    n, k = weight.shape
    padded = F.pad(weight, (0, 0, 0, -n % OUTPUTS))
    return padded.view(-1, OUTPUTS, k // INPUTS, INPUTS).transpose(1, 2).contiguous()


def rows_mm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] int8, `packed` = pack(weight [n, K]) -> x @ weight^T [M, n], exact integers in fp32."""
    return _kernel_ops().int8_rows_mm(x, packed, n)


def rows_or_int_mm(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] int8, weight [N, K] int8 and its `pack` -> x @ weight^T [M, N] int32 (as `torch._int_mm`): up to
    `INT_MM_ROWS` rows through the kernel, more through `torch._int_mm`, decided per call."""
    return _kernel_ops().int8_rows_or_int_mm(x, weight, packed, INT_MM_ROWS)


def _kernel_ops():
    if not loaded():  # loaded where `usable` was asked; a compile worker loads it here
        raise RuntimeError("the AVX2 int8 kernel could not be loaded in this process")
    return torch.ops.minigpt_cpu


def reference(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    weight = packed.transpose(1, 2).reshape(-1, packed.shape[1] * INPUTS)[:n]
    return (x.double() @ weight.double().t()).float()


def _rows_mm_shape(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


def _rows_or_int_mm_shape(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, max_rows: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.int32)
