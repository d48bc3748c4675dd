"""Seed 000: N client threads each submit one query at the same moment; one engine batches them.

    python scripts/make_checkpoint.py /tmp/gpt2-random --preset gpt2
    python scripts/concurrent_queries.py --model /tmp/gpt2-random -n 100 --baseline-queries 10

Every query (a 5-40 token prompt) asks for 64 greedy tokens with ignore_eos. The same queries then
run one at a time on the same engine; `--baseline-queries K` times only the first K and
extrapolates to N (said so in the table). Prints a markdown table: model steps, average batch
size, time and tokens/s of both, and the throughput ratio. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from dataclasses import dataclass

from minigpt import AsyncLLM, SamplingParams
from minigpt.async_llm.metrics import EngineMetrics

WORDS = (
    "the river morning garden light music window story market winter history family country question "
    "city house water letter night power system program school number change people world little great"
).split()


@dataclass
class Run:
    queries: int
    tokens: int
    steps: int
    batched: int  # sum over steps of the batch size
    seconds: float
    outputs: list[list[int]]

    @property
    def average_batch(self) -> float:
        return self.batched / self.steps


def make_prompts(llm: AsyncLLM, n: int, seed: int) -> list[list[int]]:
    """n prompts of 5 to 40 tokens, English-ish words cut to an exact token count."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(5, 40)
        ids = llm.tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(length)).capitalize())
        prompts.append(ids[:length])
    return prompts


def _since(before: EngineMetrics, after: EngineMetrics) -> tuple[int, int]:
    """(steps, sum of batch sizes) run between two snapshots."""
    old = before.batch_size_histogram
    batched = sum(size * (n - old.get(size, 0)) for size, n in after.batch_size_histogram.items())
    return after.num_steps - before.num_steps, batched


def concurrent(llm: AsyncLLM, prompts: list[list[int]], params: SamplingParams) -> Run:
    """Each prompt from its own thread, all released by one barrier."""
    barrier = threading.Barrier(len(prompts) + 1)
    outputs: list[list[int]] = [[] for _ in prompts]
    ends = [0.0] * len(prompts)

    def client(i: int) -> None:
        barrier.wait()
        outputs[i] = llm.submit(prompts[i], params).result().token_ids
        ends[i] = time.perf_counter()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    before = llm.metrics()
    barrier.wait()
    start = time.perf_counter()
    while any(t.is_alive() for t in threads):
        time.sleep(2)
        m = llm.metrics()
        print(f"  concurrent: {m.requests_finished - before.requests_finished}/{len(prompts)} done, "
              f"{m.num_steps - before.num_steps} steps, {m.requests_running} running", file=sys.stderr)
    steps, batched = _since(before, llm.metrics())
    return Run(len(prompts), sum(map(len, outputs)), steps, batched, max(ends) - start, outputs)


def one_at_a_time(llm: AsyncLLM, prompts: list[list[int]], params: SamplingParams) -> Run:
    before, start, outputs = llm.metrics(), time.perf_counter(), []
    for i, prompt in enumerate(prompts):
        outputs.append(llm.submit(prompt, params).result().token_ids)
        print(f"  one at a time: {i + 1}/{len(prompts)} done, {time.perf_counter() - start:.1f} s", file=sys.stderr)
    seconds = time.perf_counter() - start
    steps, batched = _since(before, llm.metrics())
    return Run(len(prompts), sum(map(len, outputs)), steps, batched, seconds, outputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory or hub id")
    parser.add_argument("-n", "--clients", type=int, default=100, help="client threads, one query each")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--baseline-queries", type=int, help="time only the first K one-at-a-time queries "
                        "and extrapolate to N (default: all N)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    k = min(args.baseline_queries or args.clients, args.clients)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    with AsyncLLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs) as llm:
        prompts = make_prompts(llm, args.clients, args.seed)
        llm.submit(prompts[0], SamplingParams(max_tokens=2)).result()  # warm up
        print(f"{args.clients} concurrent queries x {args.max_tokens} tokens ...", file=sys.stderr)
        batched = concurrent(llm, prompts, params)
        print(f"{k} queries one at a time ...", file=sys.stderr)
        alone = one_at_a_time(llm, prompts[:k], params)

    scale = args.clients / k
    same = sum(a == b for a, b in zip(alone.outputs, batched.outputs, strict=False))
    alone_seconds = alone.seconds * scale
    alone_tps = alone.tokens / alone.seconds
    batched_tps = batched.tokens / batched.seconds
    note = f" (timed {k}, extrapolated x{scale:g})" if k < args.clients else ""
    print(f"\nSeed 000 on `{args.model}` ({args.dtype}): {args.clients} queries x {args.max_tokens} greedy tokens\n")
    print("| mode | queries | tokens | model steps | avg batch size | time (s) | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| one at a time{note} | {args.clients} | {round(alone.tokens * scale)} | {round(alone.steps * scale)} "
          f"| {alone.average_batch:.1f} | {alone_seconds:.1f} | {alone_tps:.1f} |")
    print(f"| {args.clients} threads at once | {args.clients} | {batched.tokens} | {batched.steps} "
          f"| {batched.average_batch:.1f} | {batched.seconds:.1f} | {batched_tps:.1f} |")
    print(f"\nThroughput ratio: {batched_tps / alone_tps:.1f}x. "
          f"Greedy outputs identical in both modes: {same}/{k} queries.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
