"""The bf16 products of one decode step at batch 1, alone: every linear of a GPT-2 shape (4 per block and
the tied LM head) against one row, the way the engine runs them on a CPU with bf16 arithmetic (oneDNN's
packed weights, `cpu_linear.PackedLinear`) and the fastest other way torch offers (a reduction inductor
fuses with the weights' bf16 -> fp32 conversion), alternated, medians over `--repeats`; the memory read
probe of `scripts/bench.py` before and after. The floor under bf16 + compile's time per token
(scripts/PERFORMANCE.md, "bf16 + compile against llama.cpp bf16").

    python scripts/bench_bf16_products.py --preset gpt2 [--repeats 11 --threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers as P  # noqa: E402 - scripts/ is not a package

from minigpt.model.checkpoint import PRESETS  # noqa: E402
from minigpt.model.config import GPT2Config  # noqa: E402


def step_weights(preset: str) -> list[torch.Tensor]:
    """The weights one decode step reads, [out, in] bf16 (random: the time does not depend on values)."""
    n_layer, _, c = PRESETS[preset]
    block = [(3 * c, c), (c, c), (4 * c, c), (c, 4 * c)]
    return [torch.randn(rows, cols).bfloat16() for _ in range(n_layer) for rows, cols in block] + [
        torch.randn(GPT2Config().vocab_size, c).bfloat16()]


def one_row_reduction(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.float() * weight.float()).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2", choices=list(PRESETS))
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=P.THREADS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = step_weights(args.preset)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    rows = {w.shape[1]: torch.randn(1, w.shape[1]).bfloat16() for w in weights}
    reduce = torch.compile(one_row_reduction, dynamic=False)
    ways: dict[str, Callable[[], object]] = {
        "oneDNN packed (the engine's)": lambda: [
            torch.ops.mkldnn._linear_pointwise(rows[w.shape[1]], p, None, "none", [], "")
            for w, p in zip(weights, packed, strict=True)],
        "inductor one-row reduction": lambda: [reduce(rows[w.shape[1]], w) for w in weights],
    }
    before = P.memory_bandwidth_gbs()["read_sum_gbs"]
    times: dict[str, list[float]] = {name: [] for name in ways}
    for run in ways.values():  # compile, warm
        run()
        run()
    for _ in range(args.repeats):
        for name, run in ways.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    after = P.memory_bandwidth_gbs()["read_sum_gbs"]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    print(f"{args.preset}: {len(weights)} bf16 products, {nbytes / 1e6:.0f} MB a step, {args.threads} threads, "
          f"read probe {before:.1f} GB/s before, {after:.1f} after")
    for name in ways:
        median = statistics.median(times[name])
        print(f"  {name:30s} {median * 1e3:8.2f} ms  {nbytes / median / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
