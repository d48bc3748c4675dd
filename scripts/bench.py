"""Benchmark minigpt against the engines people use for GPT-2, side by side, on one checkpoint.

    python scripts/make_checkpoint.py checkpoints/gpt2-random --preset gpt2
    python scripts/bench.py --model checkpoints/gpt2-random                  # every workload, every engine found
    python scripts/bench.py --model checkpoints/gpt2-random --workloads stream,seed000 --engines minigpt,transformers
    python scripts/bench.py --model checkpoints/gpt2-random --device cuda --dtypes bfloat16,minigpt:bfloat16+eager

Workloads (scripts/workloads.py) reproduce the seed write-ups:
  seed000  N concurrent queries x 64 greedy tokens: one-at-a-time vs batched (calls, avg batch size)
  seed002  throughput and per-step latency for batch sizes 1..128 (plotted)
  stream   one stream, 8-token prompt, 128 tokens: TTFT, TPOT, tok/s, GB/s and % of the bandwidth bound
  serving  Poisson arrivals at several rates: TTFT/TPOT p50/p99 and throughput

Before its workloads, each engine and mode is started --starts times in a fresh process
(scripts/start_probe.py): the first start (which may convert the checkpoint or build a compile
cache) and the last one are reported, with that process's peak resident memory.

Every engine gets the same prompt token ids and generates exactly max_new_tokens greedy tokens
(EOS ignored). Numbers are medians over --repeats runs, measured in this one process, one after
the other; the run waits for the machine to be quiet first and reports the other load it saw.
Progress goes to stderr, a markdown table per workload to stdout, JSON (and a PNG plot when
matplotlib is installed) to --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers as P  # noqa: E402 - scripts/ is not a package
import workloads as W  # noqa: E402

from minigpt import LLM, AsyncLLM, SamplingParams  # noqa: E402
from minigpt.common import cpu_class  # noqa: E402
from minigpt.quant.quantize import QUANTIZATIONS  # noqa: E402


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


class MinigptPeer(P.Peer):
    """minigpt through its public API: LLM.generate for batches, AsyncLLM for serving."""

    name = "minigpt"
    devices = ("cpu", "cuda")
    # "+compile": the same mode with EngineConfig.compile (its one-time compile is not timed).
    dtypes = tuple(mode + option for option in ("", "+compile") for mode in ("float32", "bfloat16", *QUANTIZATIONS))
    # "+kv-float16", "+kv-bfloat16": a compiled mode over a half-precision KV pool (kv_cache_dtype); "+eager": a
    # float mode on CUDA with EngineConfig.enforce_eager (no CUDA graphs); "+no-overlap": a float mode on CUDA
    # with overlap="off" (each step reads its tokens before the next is laid out); "+invariant":
    # EngineConfig.batch_invariant (CPU); run when named.
    extra_dtypes = (
        *(f"{mode}+kv-{kv}" for mode in dtypes if "+" in mode for kv in ("float16", "bfloat16")),
        "float16", "float32+eager", "float16+eager", "bfloat16+eager", "float32+no-overlap", "bfloat16+no-overlap",
        *(f"{mode}+invariant" for mode in ("float32", "bfloat16", "w8a8", "w8a8+compile+kv-float16")),
    )

    def __init__(self) -> None:
        super().__init__()
        self.llm: LLM | None = None

    def unavailable_reason(self) -> str | None:
        return None

    def _engine_args(self, mode: str) -> dict:
        dtype, *options = mode.split("+")
        args = {"dtype": dtype, "device": self.device, "num_threads": P.THREADS, "compile": "compile" in options,
                "enforce_eager": "eager" in options, "batch_invariant": "invariant" in options,
                "overlap": "off" if "no-overlap" in options else "auto"}
        for option in options:
            if option.startswith("kv-"):
                args["kv_cache_dtype"] = option.removeprefix("kv-")
        if dtype in QUANTIZATIONS:
            args.update(dtype="float32", quantize=dtype)
        return args

    def prepare(self, checkpoint_dir: str | Path, dtype: str) -> None:
        self.close()
        self.checkpoint_dir, self.dtype = Path(checkpoint_dir), dtype
        self.llm = LLM(str(checkpoint_dir), max_num_seqs=256, **self._engine_args(dtype))

    def _params(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)

    def run_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int | None = None
    ) -> P.BatchResult:
        engine = self.llm.engine
        steps0 = engine.num_steps
        groups = P.chunks(list(prompts), batch_size or len(prompts))
        start = time.perf_counter()
        outs = [o for group in groups for o in self.llm.generate([list(p) for p in group],
                                                                 self._params(max_new_tokens), progress=False)]
        seconds = time.perf_counter() - start
        steps = engine.num_steps - steps0
        mode = "one-by-one" if batch_size == 1 else f"continuous {len(prompts)}"
        return P.BatchResult(
            self.name, self.dtype, mode, len(prompts), sum(len(p) for p in prompts),
            sum(len(o.token_ids) for o in outs), seconds, steps, steps, max_new_tokens, [o.token_ids for o in outs],
        )

    def run_stream(self, prompt: Sequence[int], max_new_tokens: int) -> P.StreamResult:
        start = time.perf_counter()
        out = self.llm.generate([list(prompt)], self._params(max_new_tokens), progress=False)[0]
        seconds = time.perf_counter() - start
        m = out.metrics
        return P.StreamResult(self.name, self.dtype, len(prompt), len(out.token_ids), m.time_to_first_token,
                              m.time_per_output_token, seconds, out.token_ids)

    def run_serving(self, requests: Sequence[W.ServingRequest], rate: float = float("nan")) -> P.ServingResult:
        """Requests submitted at their arrival times to a fresh AsyncLLM (every prompt new to its prefix
        cache): continuous batching. The peer's LLM is closed first, to free its memory, and stays closed:
        serving is the bench's last workload, and rebuilding a compiled engine takes minutes (`prepare`
        again to run batches)."""
        result = P.ServingResult(self.name, self.dtype, "continuous batching", rate)
        self.close()
        with AsyncLLM(str(self.checkpoint_dir), max_num_seqs=256, **self._engine_args(self.dtype)) as llm:
            llm.submit([1, 2, 3], self._params(4)).result()  # warm up
            start = time.perf_counter()
            lock = threading.Lock()
            threads = []

            def client(req: W.ServingRequest) -> None:
                try:
                    handle = llm.submit(req.prompt.token_ids, self._params(req.max_new_tokens))
                except (ValueError, RuntimeError) as err:  # reported, and missing from the results
                    log(f"serving request refused: {err}")
                    return
                first = None
                for delta in handle:
                    if first is None and delta.token_ids:
                        first = time.perf_counter() - start
                out = handle.result()
                end = time.perf_counter() - start
                timing = P.RequestTiming(req.arrival_s, first if first is not None else end, end,
                                         len(req.prompt.token_ids), len(out.token_ids))
                with lock:
                    result.requests.append(timing)

            for req in sorted(requests, key=lambda r: r.arrival_s):
                delay = req.arrival_s - (time.perf_counter() - start)
                if delay > 0:
                    time.sleep(delay)
                thread = threading.Thread(target=client, args=(req,), daemon=True)
                thread.start()
                threads.append(thread)
            for thread in threads:
                thread.join()
        return result

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None


WORKLOADS = ("stream", "seed000", "seed002", "serving")  # in the order they run, each engine in turn
BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "w8a8": 1, "q8_0": 34 / 32, "q4_0": 18 / 32}


def table(headers: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        return f"{v:,.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ckpt = Path(args.model)
        self.encode = W.load_encoder(self.ckpt)
        self.results: dict[str, list] = {}
        if args.device == "cpu":
            self.bandwidth = P.memory_bandwidth_gbs()["read_sum_gbs"]
        else:
            self.bandwidth = P.device_bandwidth_gbs(args.device)["read_sum_gbs"]
        self.cpu_class = cpu_class.describe()
        log(f"{args.device} memory bandwidth (read): {self.bandwidth:.1f} GB/s; CPU class {self.cpu_class}")

    def engines(self) -> list[tuple[P.Peer, str]]:
        chosen = set(self.args.engines.split(",")) if self.args.engines else None
        wanted = self.args.dtypes.split(",") if self.args.dtypes else None
        every = (MinigptPeer(), *P.all_peers())
        unknown = sorted((chosen or set()) - {peer.name for peer in every})
        if unknown:
            raise SystemExit(f"--engines: no engine {', '.join(unknown)}; known: {', '.join(p.name for p in every)}")
        peers = [p for p in every if chosen is None or p.name in chosen]
        known = {name for peer in peers for d in peer.dtypes + peer.extra_dtypes for name in (d, f"{peer.name}:{d}")}
        unknown = [w for w in wanted or [] if w not in known]
        if unknown:
            raise SystemExit(f"--dtypes: no engine has {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        pairs = []
        for peer in peers:
            peer.device = self.args.device
            reason = peer.unavailable_reason()
            if self.args.device not in peer.devices:
                reason = f"runs on {', '.join(peer.devices)} here, not {self.args.device}"
            if reason is not None:
                log(f"skip {peer.name}: {reason}")
                continue
            if wanted is None:
                dtypes = list(peer.dtypes)
            else:
                dtypes = [d for d in peer.dtypes + peer.extra_dtypes if d in wanted or f"{peer.name}:{d}" in wanted]
            pairs += [(peer, d) for d in dtypes]
        return pairs

    def measured(self, fn, label: str):
        if self.args.wait_quiet:
            P.wait_until_quiet(log=log)
        with P.OtherLoad() as load:
            out = fn()
        if load.share > 0.1:
            log(f"warning: other processes used {load.share:.0%} of the cores during {label}")
        return out

    def run(self) -> None:
        wanted = self.args.workloads.split(",")
        for peer, dtype in self.engines():
            self.starts(peer, dtype)
            log(f"preparing {peer.name} {dtype}")
            try:
                peer.prepare(self.ckpt, dtype)
            except Exception as err:  # a peer that fails to convert/load is reported, not fatal
                log(f"skip {peer.name} {dtype}: {type(err).__name__}: {err}")
                continue
            for name in WORKLOADS:
                if name in wanted:
                    log(f"{name}: {peer.name} {dtype}")
                    getattr(self, name)(peer, dtype)
            peer.close()
            self.save()  # an interrupted run keeps what it measured
        self.report()

    def starts(self, peer: P.Peer, dtype: str) -> None:
        """Start time and peak memory of `peer` in `dtype`, each start in a fresh process."""
        probe = [sys.executable, str(Path(__file__).resolve().parent / "start_probe.py"), "--engine", peer.name,
                 "--mode", dtype, "--model", str(self.ckpt)]
        runs = []
        for i in range(self.args.starts):
            log(f"start {i + 1}/{self.args.starts}: {peer.name} {dtype}")
            proc = self.measured(lambda: subprocess.run(probe, capture_output=True, text=True, check=False), "start")
            if proc.returncode != 0:
                log(f"  start failed: {proc.stderr.strip().splitlines()[-1:]}")
                return
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            log(f"  {runs[-1]['start_s']:.1f} s, peak {runs[-1]['peak_rss_mb']:,.0f} MB")
        if runs:
            self.results.setdefault("start", []).append({
                "label": f"{peer.name} {dtype}", "first_start_s": runs[0]["start_s"], "start_s": runs[-1]["start_s"],
                "peak_rss_mb": runs[-1]["peak_rss_mb"], "starts": runs,
            })

    def stream(self, peer: P.Peer, dtype: str) -> None:
        w = W.seed001(self.encode)
        runs = self.measured(lambda: P.repeat(lambda: peer.run_stream(w.prompt.token_ids, w.max_new_tokens),
                                              self.args.repeats), "stream")
        r = P.median_stream(runs)
        gbs = P.gpt2_decode_bytes(self.ckpt, BYTES_PER_PARAM.get(dtype.partition("+")[0], 4)) / r.tpot_s / 1e9
        self.results.setdefault("stream", []).append({**asdict(r), "token_ids": None, "label": f"{peer.name} {dtype}",
                                                      "gbs": gbs, "bandwidth_pct": 100 * gbs / self.bandwidth})
        log(f"  TTFT {1000 * r.ttft_s:.1f} ms, TPOT {1000 * r.tpot_s:.1f} ms")

    def seed000(self, peer: P.Peer, dtype: str) -> None:
        w = W.seed000(self.encode, n_prompts=self.args.queries)
        prompts = w.prompt_token_ids
        base = prompts[: self.args.baseline_queries]
        one = self.measured(lambda: peer.run_one_by_one(base, w.max_new_tokens), "one-by-one")
        scale = len(prompts) / len(base)
        batched = self.measured(lambda: P.median_batch(P.repeat(
            lambda: peer.run_batch(prompts, w.max_new_tokens), self.args.repeats, warmup=0)), "batched")
        for r, extrapolated in ((one, scale != 1), (batched, False)):
            self.results.setdefault("seed000", []).append({
                **asdict(r), "token_ids": None, "label": f"{peer.name} {dtype}", "tok_per_s": r.tok_per_s,
                "est_seconds_all": r.seconds * (scale if extrapolated else 1), "extrapolated": extrapolated,
                "avg_batch": r.tokens_generated / r.steps if r.steps else float("nan"),
            })
            log(f"  {r.mode}: {r.tok_per_s:,.1f} tok/s")

    def seed002(self, peer: P.Peer, dtype: str) -> None:
        sizes = [int(b) for b in self.args.batch_sizes.split(",")]
        for w in W.seed002(self.encode, sizes, max_new_tokens=self.args.sweep_tokens):
            r = self.measured(lambda w=w: P.median_batch(P.repeat(
                lambda: peer.run_batch(w.prompt_token_ids, w.max_new_tokens), self.args.repeats, warmup=0)),
                w.name)
            self.results.setdefault("seed002", []).append({
                "label": f"{peer.name} {dtype}", "batch": len(w.prompts), "tok_per_s": r.tok_per_s,
                "ms_per_step": 1000 * r.seconds / w.max_new_tokens,
            })
            log(f"  batch {len(w.prompts)}: {r.tok_per_s:,.1f} tok/s")

    def serving(self, peer: P.Peer, dtype: str) -> None:
        for rate in [float(x) for x in self.args.rates.split(",")]:
            w = W.serving(self.encode, rate, n_requests=self.args.serving_requests)
            r = self.measured(lambda w=w, rate=rate: peer.run_serving(w.requests, rate), w.name)
            row = {"label": f"{peer.name} {dtype}", "mode": r.mode, **r.summary()}
            self.results.setdefault("serving", []).append(row)
            log(f"  {rate:g} req/s: TTFT p50 {row['ttft_p50_ms']:,.0f} ms, TPOT p50 {row['tpot_p50_ms']:.1f} ms, "
                f"{row['tok_per_s']:,.1f} tok/s")

    def report(self) -> None:
        out = Path(self.args.out)
        print(f"Checkpoint {self.ckpt} | device {self.args.device} | threads {P.THREADS} | memory read bandwidth "
              f"{self.bandwidth:.1f} GB/s | CPU class {self.cpu_class}\n")
        if rows := self.results.get("start"):
            print("### Start and memory: a fresh process to ready, then 8 tokens\n")
            print(table(["engine", "first start s", "start s", "peak MB"],
                        [[r["label"], r["first_start_s"], r["start_s"], r["peak_rss_mb"]] for r in rows]) + "\n")
        if rows := self.results.get("stream"):
            print("### One stream (seed 001/003): 8-token prompt, 128 greedy tokens\n")
            print(table(["engine", "TTFT ms", "TPOT ms", "tok/s", "GB/s", "% of bandwidth bound"],
                        [[r["label"], 1000 * r["ttft_s"], 1000 * r["tpot_s"], r["tokens_generated"] / r["seconds"],
                          r["gbs"], r["bandwidth_pct"]] for r in rows]) + "\n")
        if rows := self.results.get("seed000"):
            print(f"### Seed 000: {self.args.queries} concurrent queries x 64 greedy tokens\n")
            print(table(["engine", "mode", "model calls/steps", "avg batch", "seconds (all queries)", "tok/s"],
                        [[r["label"], r["mode"] + (" (extrapolated)" if r["extrapolated"] else ""), r["steps"],
                          r["avg_batch"], r["est_seconds_all"], r["tok_per_s"]] for r in rows]) + "\n")
        if rows := self.results.get("seed002"):
            print(f"### Seed 002: batch-size sweep, {self.args.sweep_tokens} greedy tokens\n")
            print(table(["engine", "batch", "tok/s", "ms per step"],
                        [[r["label"], r["batch"], r["tok_per_s"], r["ms_per_step"]] for r in rows]) + "\n")
            self.plot(rows, out / "seed002.png")
        if rows := self.results.get("serving"):
            print("### Serving: Poisson arrivals, mixed prompt/output lengths\n")
            print(table(["engine", "mode", "req/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
                         "tok/s"],
                        [[r["label"], r["mode"], r["rate"], r["ttft_p50_ms"], r["ttft_p99_ms"], r["tpot_p50_ms"],
                          r["tpot_p99_ms"], r["tok_per_s"]] for r in rows]) + "\n")
        log(f"wrote {self.save()}")

    def save(self) -> Path:
        """bench.json with every result so far."""
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "bench.json"
        path.write_text(json.dumps({"checkpoint": str(self.ckpt), "device": self.args.device, "threads": P.THREADS,
                                    "bandwidth_gbs": self.bandwidth,
                                    "cpu_class": self.cpu_class, **self.results}, indent=2))
        return path

    @staticmethod
    def plot(rows: list[dict], path: Path) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log("no matplotlib: skipping the plot (pip install 'minigpt[plots]')")
            return
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for label in dict.fromkeys(r["label"] for r in rows):
            mine = [r for r in rows if r["label"] == label]
            ax1.plot([r["batch"] for r in mine], [r["tok_per_s"] for r in mine], marker="o", label=label)
            ax2.plot([r["batch"] for r in mine], [r["ms_per_step"] for r in mine], marker="o", label=label)
        for ax, ylabel in ((ax1, "throughput (tok/s)"), (ax2, "latency per token (ms per step)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        ax1.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        log(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a local GPT-2 checkpoint directory")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where every engine runs (on cuda: minigpt and transformers); GB/s against its memory")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma list of {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--engines", default=None, help="comma list: minigpt,transformers,ctranslate2,llama.cpp")
    parser.add_argument("--dtypes", default=None,
                        help="comma list to restrict to: dtypes (float32,int8) or engine:dtype (minigpt:w8a8)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each workload but serving (once per rate); numbers are their medians")
    parser.add_argument("--queries", type=int, default=100, help="seed 000: concurrent queries")
    parser.add_argument("--baseline-queries", type=int, default=10,
                        help="seed 000: queries timed one at a time (the rest extrapolated)")
    parser.add_argument("--batch-sizes", default=",".join(map(str, W.BATCH_SIZES)), help="seed 002: comma list")
    parser.add_argument("--sweep-tokens", type=int, default=32, help="seed 002: tokens per prompt")
    parser.add_argument("--rates", default="2,8", help="serving: requests per second")
    parser.add_argument("--serving-requests", type=int, default=32, help="serving: requests at each rate")
    parser.add_argument("--starts", type=int, default=2,
                        help="fresh-process starts per engine and mode, for start time and peak memory (0: none)")
    parser.add_argument("--out", default="results", help="folder for the JSON results and the plot")
    parser.add_argument("--cpu-class", default="native", choices=("native", *cpu_class.FORCE),
                        help="run torch, oneDNN, fbgemm and CTranslate2 at a lower x86 class than this CPU's")
    parser.add_argument("--no-wait", dest="wait_quiet", action="store_false",
                        help="measure at once instead of waiting for other processes to settle")
    args = parser.parse_args(argv)
    unknown = [name for name in args.workloads.split(",") if name not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: no workload {', '.join(map(repr, unknown))}; known: {', '.join(WORKLOADS)}")
    if not (Path(args.model) / "config.json").exists():
        parser.error(f"{args.model} is not a checkpoint directory (python scripts/make_checkpoint.py DIR writes one)")
    P.run_at_cpu_class(args.cpu_class)
    Bench(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
