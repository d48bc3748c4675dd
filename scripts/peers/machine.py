"""The machine a benchmark runs on: its thread count, memory bandwidth, and the load other processes put on it."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

THREADS = int(os.environ.get("MINIGPT_BENCH_THREADS", os.cpu_count() or 1))


def run_at_cpu_class(name: str) -> None:
    """Re-run this command with the variables that hold torch, oneDNN, fbgemm and CTranslate2 to `name` (on
    an AVX-512 machine, the AVX2 paths measured); llama.cpp runs the instructions its build was made for."""
    from minigpt.common import cpu_class

    if name == "native":
        return
    problem = cpu_class.unusable(name)
    if problem:
        raise SystemExit(f"--cpu-class {name}: {problem}")
    wanted = {**cpu_class.FORCE[name], "CT2_FORCE_CPU_ISA": "AVX2"}
    if any(os.environ.get(key) != value for key, value in wanted.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **wanted})


def memory_bandwidth_gbs(n_bytes: int = 1 << 30, repeats: int = 7) -> dict[str, float]:
    """Measured memory bandwidth in GB/s: a large fp32 sum (read only) and copy (read + write), over huge pages
    where minigpt puts its weights in them (they read faster: the bound is the faster rate)."""
    import torch

    from minigpt.common.huge_pages import huge_page_bytes, huge_pages_on

    torch.set_num_threads(THREADS)

    def buffer() -> torch.Tensor:
        if huge_pages_on():
            return torch.frombuffer(huge_page_bytes(n_bytes // 4 * 4), dtype=torch.float32)
        return torch.empty(n_bytes // 4, dtype=torch.float32)

    x, y = buffer(), buffer()
    x.fill_(1)
    y.copy_(x)  # touch every page first

    def best(fn: Callable[[], Any], moved: int) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return moved / statistics.median(times) / 1e9

    return {
        "read_sum_gbs": best(lambda: x.sum(), n_bytes),
        "copy_gbs": best(lambda: y.copy_(x), 2 * n_bytes),
    }


def device_bandwidth_gbs(device: str, n_bytes: int = 1 << 30, repeats: int = 7) -> dict[str, float]:
    """`memory_bandwidth_gbs` of a GPU's memory: the same sum and copy, timed after the device has finished."""
    import torch

    x = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)

    def best(fn: Callable[[], Any], moved: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
        return moved / statistics.median(times) / 1e9

    return {
        "read_sum_gbs": best(lambda: x.sum(), n_bytes),
        "copy_gbs": best(lambda: y.copy_(x), 2 * n_bytes),
    }


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]  # idle + iowait
    return sum(vals) - idle, sum(vals)


def cpu_busy(interval: float = 1.0) -> float:
    """Fraction of all cores busy over ``interval`` seconds (Linux /proc/stat; nan elsewhere).

    A timing on a few cores means nothing while something else runs on them."""
    try:
        b0, t0 = _cpu_times()
        time.sleep(interval)
        b1, t1 = _cpu_times()
    except OSError:
        return float("nan")
    return (b1 - b0) / max(1, t1 - t0)


class OtherLoad:
    """Context manager: the share of the machine's cores that *other* processes used meanwhile.

    Total busy time (from /proc/stat) minus this process's own CPU time (all its threads and
    waited-for children), over cores x wall time.
    """

    share: float = float("nan")

    def __enter__(self) -> OtherLoad:
        self._own0 = sum(os.times()[:4])
        self._wall0 = time.perf_counter()
        try:
            self._busy0 = _cpu_times()[0]
        except OSError:
            self._busy0 = -1
        return self

    def __exit__(self, *exc: object) -> None:
        if self._busy0 < 0:
            return
        wall = time.perf_counter() - self._wall0
        busy = (_cpu_times()[0] - self._busy0) / os.sysconf("SC_CLK_TCK")
        own = sum(os.times()[:4]) - self._own0
        self.share = max(0.0, busy - own) / ((os.cpu_count() or 1) * max(wall, 1e-9))


def wait_until_quiet(max_busy: float = 0.15, timeout_s: float = 300.0, log: Callable[[str], None] = print) -> float:
    """Block until the machine is (nearly) idle or ``timeout_s`` passes; returns the last busy fraction."""
    deadline = time.monotonic() + timeout_s
    busy = cpu_busy()
    while busy > max_busy and time.monotonic() < deadline:
        log(f"machine {busy:.0%} busy with other work; waiting for it to settle")
        busy = cpu_busy(5.0)
    return busy
