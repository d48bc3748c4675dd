"""Speculative decoding, side by side with plain decoding in one run: greedy tokens/s at batch 1 and 8.

    python scripts/bench_speculative.py --workdir checkpoints/spec [--max-tokens 48 --repeats 3]

Workloads (random weights: checkpoints are written into --workdir on first use):
  ngram     gpt2-shaped target, n-gram lookup, prompts of a repeated pattern whose greedy output repeats it
  draft     24-layer gpt2-width target drafted by its own first 6 layers (a distilgpt2-shaped draft)
  ceiling   gpt2-shaped target drafted by itself: acceptance 1, the overhead of drafting and verifying

Each speculative mode runs adaptive (k chosen per sequence, the default) and fixed (k every step);
outputs are checked equal to plain decoding. Numbers are medians over --repeats runs.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from minigpt import LLM, SamplingParams
from minigpt.model.checkpoint import preset_config, random_model, write_checkpoint
from minigpt.tokenizer.tokenizer import gpt2_vocab_files


def checkpoints(workdir: Path) -> dict[str, Path]:
    paths = {name: workdir / name for name in ("gpt2", "target24", "draft6")}
    if not (paths["gpt2"] / "config.json").is_file():
        write_checkpoint(random_model(preset_config("gpt2"), seed=0), paths["gpt2"], gpt2_vocab_files())
    if not (paths["draft6"] / "config.json").is_file():
        target = random_model(preset_config("gpt2", n_layer=24), seed=1)
        write_checkpoint(target, paths["target24"], gpt2_vocab_files())
        draft = copy.deepcopy(target)
        draft.h = draft.h[:6]
        draft.config = replace(draft.config, n_layer=6)
        write_checkpoint(draft, paths["draft6"], gpt2_vocab_files())
    return paths


def prompts(kind: str, batch: int) -> list[list[int]]:
    rng = random.Random(batch)
    if kind == "ngram":  # a pattern of 8 tokens repeated 4 times
        return [[rng.randrange(50000) for _ in range(8)] * 4 for _ in range(batch)]
    return [[rng.randrange(50000) for _ in range(32)] for _ in range(batch)]


def measure(llm: LLM, batch_prompts, max_tokens: int, repeats: int) -> tuple[float, list, float | None]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate(batch_prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    times, outs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(batch_prompts, params)
        times.append(time.perf_counter() - start)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    return len(batch_prompts) * max_tokens / statistics.median(times), [o.token_ids for o in outs], (
        accepted / drafted if drafted else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("checkpoints/spec"))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--workloads", default="ngram,draft,ceiling")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    paths = checkpoints(args.workdir)
    setups = {
        "ngram": (paths["gpt2"], {"method": "ngram", "num_speculative_tokens": args.k}),
        "draft": (paths["target24"], {"method": "draft_model", "model": str(paths["draft6"]),
                                      "num_speculative_tokens": args.k}),
        "ceiling": (paths["gpt2"], {"method": "draft_model", "model": str(paths["gpt2"]),
                                    "num_speculative_tokens": args.k}),
    }
    threads = args.threads or torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, {args.max_tokens} greedy tokens per sequence, "
          f"median of {args.repeats}")
    print("| workload | batch | plain tok/s | adaptive tok/s (x) | fixed k tok/s (x) | acceptance (fixed k) |")
    print("|---|---|---|---|---|---|")
    for name in args.workloads.split(","):
        target, spec = setups[name]
        engine = {"num_threads": args.threads, "kv_cache_tokens": 8192}
        llms = {"plain": LLM(str(target), **engine), "adaptive": LLM(str(target), speculative_config=spec, **engine),
                "fixed": LLM(str(target), speculative_config={**spec, "adaptive": False}, **engine)}
        for batch in map(int, args.batches.split(",")):
            batch_prompts = prompts(name, batch)
            results = {mode: measure(llm, batch_prompts, args.max_tokens, args.repeats) for mode, llm in llms.items()}
            base, want, _ = results["plain"]
            for mode, (_, got, _) in results.items():
                if got != want:
                    print(f"{name} batch {batch}: {mode} output differs from plain decoding", file=sys.stderr)
                    return 1
            adaptive, fixed = results["adaptive"][0], results["fixed"][0]
            acceptance = results["fixed"][2]
            print(f"| {name} | {batch} | {base:.1f} | {adaptive:.1f} ({adaptive / base:.2f}x) | "
                  f"{fixed:.1f} ({fixed / base:.2f}x) | {acceptance if acceptance is None else round(acceptance, 3)} |",
                  flush=True)
        for llm in llms.values():
            llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
