"""Tensor parallelism on one machine: 1 rank with T threads against N ranks with T/N threads each
(and, as a control, 1 rank with T/N threads), on one stream and on a batch of concurrent queries,
with where rank 0's step time goes.

    python scripts/bench_tensor_parallel.py --model checkpoints/gpt2-random [--ranks 2 --threads 2]

Per setup: tok/s and ms per step (medians of --repeats), and for N ranks the time rank 0 spends in
the all-reduces per step (the collective itself plus waiting for the slowest rank) and in pickling the
step for the workers. Then the bare latency of one all-reduce of one token's activations between two
processes, with nothing else running. Results as a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import workloads as W  # noqa: E402

from minigpt import LLM, SamplingParams  # noqa: E402
from minigpt.tensor_parallel.group import all_reducer, join_store, open_group, open_store  # noqa: E402
from minigpt.tensor_parallel.runner import model_inputs, pack  # noqa: E402


class Timed:
    """Wraps a function, adding up the seconds spent in it."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def run_setup(model: str, ranks: int, threads: int, stream: W.StreamWorkload, batch: W.BatchWorkload,
              repeats: int) -> list[list]:
    llm = LLM(model, tensor_parallel_size=ranks, num_threads=threads, kv_cache_tokens=8192)
    engine = llm.engine
    runner = engine.runner
    reduce = None
    if ranks > 1:
        reduce = runner.shard.all_reduce = Timed(runner.shard.all_reduce)
    prepare = runner.prepare
    last = []
    runner.prepare = lambda *args: last.append(prepare(*args)) or last[-1]
    rows = []
    for workload, prompts, n in (("stream", [stream.prompt.token_ids], stream.max_new_tokens),
                                 (batch.name, batch.prompt_token_ids, batch.max_new_tokens)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
        times, step_ms, reduce_ms = [], [], []
        for _ in range(repeats):
            steps = engine.num_steps
            if reduce is not None:
                reduce.seconds = reduce.calls = 0
            start = time.perf_counter()
            llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            steps = engine.num_steps - steps
            times.append(elapsed)
            step_ms.append(1e3 * elapsed / steps)
            if reduce is not None:
                reduce_ms.append(1e3 * reduce.seconds / steps)
        decode_step = last[-1]  # the last step of the last run: all decodes
        start = time.perf_counter()
        for _ in range(100):
            pickle.dumps(model_inputs(decode_step, pack), protocol=pickle.HIGHEST_PROTOCOL)
        pickle_ms = 1e3 * (time.perf_counter() - start) / 100
        tokens = len(prompts) * n
        rows.append([workload, f"{ranks} x {threads} thread{'s' * (threads > 1)}",
                     f"{tokens / statistics.median(times):.1f}", f"{statistics.median(step_ms):.2f}",
                     f"{statistics.median(reduce_ms):.2f}" if reduce_ms else "-",
                     f"{pickle_ms:.3f}" if ranks > 1 else "-"])
        print("[bench]", *rows[-1], file=sys.stderr, flush=True)
        last.clear()
    llm.close()
    return rows


def _reduce_peer(port: int, width: int, calls: int) -> None:
    torch.set_num_threads(1)
    reduce = all_reducer(open_group(join_store(port, 2), 1, 2, torch.device("cpu")))
    x = torch.ones(1, width)
    for _ in range(calls):
        reduce(x)


def bare_all_reduce_us(width: int, calls: int = 2000) -> float:
    """Mean time of `calls` all-reduces of a [1, width] fp32 tensor between two processes."""
    torch.set_num_threads(1)
    store = open_store(2)
    peer = mp.get_context("spawn").Process(target=_reduce_peer, args=(store.port, width, calls + 100))
    peer.start()
    reduce = all_reducer(open_group(store, 0, 2, torch.device("cpu")))
    x = torch.ones(1, width)
    for _ in range(100):
        reduce(x)
    start = time.perf_counter()
    for _ in range(calls):
        reduce(x)
    elapsed = time.perf_counter() - start
    peer.join()
    return 1e6 * elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local GPT-2 checkpoint directory")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="threads in all: one rank gets them all")
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--query-tokens", type=int, default=64, help="new tokens per query")
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    encode = W.load_encoder(args.model)
    stream = W.seed001(encode, max_new_tokens=args.stream_tokens)
    batch = W.seed000(encode, n_prompts=args.queries, max_new_tokens=args.query_tokens)
    share = args.threads // args.ranks
    rows = []  # 1 rank with every thread, 1 rank with one rank's share (a control), N ranks
    for ranks, threads in ((1, args.threads), (1, share), (args.ranks, share)):
        rows += run_setup(args.model, ranks, threads, stream, batch, args.repeats)
    rows.sort(key=lambda row: row[0] != "stream")
    header = ["workload", "ranks x threads", "tok/s", "ms/step", "all-reduce ms/step (rank 0)", "pickle ms/step"]
    print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    width = json_width(args.model)
    print(f"\nbare all-reduce of [1, {width}] fp32, 2 processes x 1 thread (gloo, loopback): "
          f"{bare_all_reduce_us(width):.0f} us per call")


def json_width(model: str) -> int:
    from minigpt.model.config import GPT2Config

    return GPT2Config.from_json_file(Path(model) / "config.json").n_embd


if __name__ == "__main__":
    main()
