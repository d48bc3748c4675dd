"""Where a decode step's time goes: the engine's phases timed on the host, then torch's profiler.

    python scripts/profile_decode.py --model checkpoints/gpt2-random --device cuda --dtype bfloat16 --batch 1
    python scripts/profile_decode.py --model checkpoints/gpt2-random --device cuda --enforce-eager
    python scripts/profile_decode.py --model checkpoints/gpt2-random --quantize w8a8 --compile --kv-cache-dtype float16

`batch` sequences are prefilled, then `--steps` decode steps are timed: each phase of `Engine.step` on the
host clock (schedule, prepare, run: the model's launch or a graph's replay, postprocess: sampling, which
waits for the device), then the same steps under torch.profiler, whose tables (by host time and by device
time) follow. Prints to stdout, or to --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from contextlib import redirect_stdout
from pathlib import Path

import torch

from minigpt import LLM, SamplingParams
from minigpt.engine.cuda_graphs import DecodeGraphs


def timed(owner: object, name: str, totals: dict[str, float]) -> None:
    """Wrap `owner.name` so each call adds its host time to totals[name]."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def profile(args: argparse.Namespace) -> None:
    llm = LLM(args.model, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
              max_num_seqs=max(args.batch, 1), quantize=args.quantize, compile=args.compile,
              kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    params = SamplingParams(max_tokens=3 * args.steps + 8, ignore_eos=True)
    for i in range(args.batch):
        engine.add(engine.make_request([10 + i, 11, 12, 13, 14, 15, 16, 17], params))
    for _ in range(4):  # the prefill, then decode steps to warm up
        engine.step()
    totals: dict[str, float] = defaultdict(float)
    timed(engine.scheduler, "schedule", totals)
    timed(engine.runner, "prepare", totals)
    timed(engine.runner, "run", totals)
    timed(engine, "_postprocess", totals)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - start) / args.steps
    graphs = "CUDA graphs" if isinstance(engine.runner.forward_path, DecodeGraphs) else "eager"
    mode = " ".join(f"{name} {value}" for name, value in (("quantize", args.quantize), ("compile", args.compile),
                                                           ("KV", args.kv_cache_dtype)) if value)
    print(f"{args.model} | {args.device} {args.dtype} {mode} | {graphs} | batch {args.batch} | "
          f"{1000 * wall:.3f} ms per decode step over {args.steps} steps")
    for name, total in totals.items():
        print(f"  {name:<13} {1000 * total / args.steps:8.3f} ms per step")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
    averages = prof.key_averages()
    print(f"\ntorch.profiler, {args.steps} steps, by host time:")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.device == "cuda":
        print(f"\ntorch.profiler, {args.steps} steps, by device time:")
        print(averages.table(sort_by="self_device_time_total", row_limit=args.rows))
    llm.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a local GPT-2 checkpoint directory")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed, then profiled")
    parser.add_argument("--rows", type=int, default=25, help="rows of each profiler table")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--quantize", default=None, help="int8, w8a8 or int4 (LLM's quantize)")
    parser.add_argument("--compile", action="store_true", help="the compiled steps (LLM's compile=True)")
    parser.add_argument("--kv-cache-dtype", default=None, help="the KV pool's dtype, e.g. float16")
    parser.add_argument("--out", help="append the report to this file instead of printing it")
    args = parser.parse_args(argv)
    if args.out is None:
        profile(args)
        return 0
    with Path(args.out).open("a") as out, redirect_stdout(out):
        profile(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
