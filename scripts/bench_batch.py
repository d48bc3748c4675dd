"""Batch jobs against the other ways to run the same requests, tokens/s side by side, and a job's peak memory.

    python scripts/make_checkpoint.py checkpoints/gpt2-random --preset gpt2
    python scripts/bench_batch.py --model checkpoints/gpt2-random        # the real run: the defaults below

Workloads (scripts/workloads.py, the same token ids everywhere, greedy, EOS ignored):
  generate  seed 000 at 10x: --queries prompts of 5-40 tokens x --max-tokens new tokens (1,000 x 64)
  score     --docs documents of --doc-tokens tokens (256-1,024), max_tokens 0 with echo and logprobs
Ways, each timed from its first request to its last result (the model already loaded):
  batch         `python -m minigpt.batch` on a request file (its --summary-json wall time)
  serve+client  the same bodies POSTed to `python -m minigpt.serve` by an httpx client, --concurrency at once
  transformers  GPT2LMHeadModel static batches of --hf-batch-size (generate; a padded forward to score)
Memory: `minigpt batch` on request files of --rss-lines lines (max_tokens 1; --rss-model, a small checkpoint
keeps it quick), the job's peak resident set: it must not grow with the file.

A markdown table goes to stdout; progress to stderr. For a quick look on a small machine:
    python scripts/bench_batch.py --model CKPT --queries 100 --max-tokens 16 --docs 20 --doc-tokens 256,512 \\
        --rss-lines 1000,10000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads as W  # noqa: E402 - scripts/ is not a package

ROOT = Path(__file__).resolve().parents[1]


def log(message: str) -> None:
    print(f"[bench_batch] {message}", file=sys.stderr, flush=True)


def generate_bodies(prompts: list[list[int]], max_tokens: int) -> list[dict]:
    return [{"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} for p in prompts]


def score_bodies(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt": p, "max_tokens": 0, "echo": True, "logprobs": 0} for p in prompts]


def write_requests(path: Path, bodies: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as out:
        for i, body in enumerate(bodies):
            out.write(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions", "body": body})
                      + "\n")


# Runs a command and prints its peak resident set in KiB: a small process to fork from, since a child's peak
# counts the pages of the process it was forked from (this one, after transformers ran, is gigabytes).
PEAK_RSS = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")


def run_batch(model: str, bodies: list[dict], work: Path, engine_flags: list[str]) -> dict:
    """`minigpt batch` on `bodies`: its summary, with the job's peak resident memory in MiB."""
    source, output, summary = work / "requests.jsonl", work / "results.jsonl", work / "summary.json"
    write_requests(source, bodies)
    output.unlink(missing_ok=True)
    job = [sys.executable, "-m", "minigpt.batch", "--model", model, "-i", str(source), "-o", str(output), "--quiet",
           "--summary-json", str(summary), *engine_flags]
    result = subprocess.run([sys.executable, "-c", PEAK_RSS, *job], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise SystemExit(f"minigpt batch failed with exit code {result.returncode}")
    return {**json.loads(summary.read_text()), "peak_rss_mib": int(result.stdout.split()[-1]) / 1024}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_serve(model: str, bodies: list[dict], concurrency: int, engine_flags: list[str]) -> dict:
    """The bodies POSTed to `minigpt serve`, `concurrency` at a time, timed from the first to the last answer."""
    import httpx

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "minigpt.serve", "--model", model, "--port", str(port),
                               "--log-level", "warning", "--limit-concurrency", str(concurrency + 64),
                               "--max-body-bytes", str(1 << 24), *engine_flags], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(6000):  # the model loads (bounded: 10 minutes)
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None:
                raise SystemExit("minigpt serve exited before it served")
            time.sleep(0.1)

        async def send_all() -> list[dict]:
            gate = asyncio.Semaphore(concurrency)
            limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
            async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
                async def send(body: dict) -> dict:
                    async with gate:
                        response = await client.post("/v1/completions", json=body)
                        response.raise_for_status()
                        return response.json()

                return await asyncio.gather(*(send(body) for body in bodies))

        start = time.perf_counter()
        answers = asyncio.run(send_all())
        seconds = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait()
    return {"requests": len(answers), "wall_time_s": seconds,
            "prompt_tokens": sum(a["usage"]["prompt_tokens"] for a in answers),
            "completion_tokens": sum(a["usage"]["completion_tokens"] for a in answers)}


def run_transformers(model: str, prompts: list[list[int]], max_tokens: int, batch_size: int) -> dict:
    """transformers' static batches: generate, or (max_tokens 0) one padded forward per batch for the logprobs."""
    import torch
    from peers.hf import HFPeer

    peer = HFPeer()
    peer.prepare(model, "float32")
    if max_tokens:
        result = peer.run_batch(prompts, max_tokens, batch_size)
        return {"requests": len(prompts), "wall_time_s": result.seconds, "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.tokens_generated}
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch_size):
            chunk = prompts[first : first + batch_size]
            width = max(map(len, chunk))
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):
                ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
            logits = peer.model(input_ids=ids, attention_mask=mask).logits
            logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])
            (logprobs[..., 0] * mask[:, 1:]).sum(dim=1).tolist()
    return {"requests": len(prompts), "wall_time_s": time.perf_counter() - start,
            "prompt_tokens": sum(map(len, prompts)), "completion_tokens": 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a checkpoint dir (scripts/make_checkpoint.py writes one)")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--docs", type=int, default=1000)
    parser.add_argument("--doc-tokens", default="256,1024", help="MIN,MAX tokens of a scored document")
    parser.add_argument("--rss-lines", default="10000,100000",
                        help="lines of the request files memory is measured on ('' for none)")
    parser.add_argument("--rss-model", default=None, help="the checkpoint memory is measured with (default: --model)")
    parser.add_argument("--concurrency", type=int, default=256, help="the client's requests in flight to serve")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--ways", default="batch,serve,transformers")
    parser.add_argument("--workloads", default="generate,score")
    parser.add_argument("--engine-flags", default="", help="more flags for minigpt batch and serve, as one string")
    args = parser.parse_args(argv)
    ways = args.ways.split(",")
    engine_flags = args.engine_flags.split()
    encode = W.load_encoder(args.model)
    low, high = (int(n) for n in args.doc_tokens.split(","))
    workloads = {
        "generate": (W.seed000(encode, n_prompts=args.queries, max_new_tokens=args.max_tokens).prompt_token_ids,
                     args.max_tokens),
        "score": ([p.token_ids for p in W.make_prompts(encode, args.docs, low, high, seed=5)], 0),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.workloads.split(","):
            prompts, max_tokens = workloads[name]
            bodies = generate_bodies(prompts, max_tokens) if max_tokens else score_bodies(prompts)
            for way in ways:
                log(f"{name}: {way} ({len(prompts)} requests)")
                if way == "batch":
                    result = run_batch(args.model, bodies, work, engine_flags)
                elif way == "serve":
                    result = run_serve(args.model, bodies, args.concurrency, engine_flags)
                else:
                    result = run_transformers(args.model, prompts, max_tokens, args.hf_batch_size)
                tokens = result["completion_tokens"] if max_tokens else result["prompt_tokens"]
                rows.append((name, way, result["requests"], tokens, result["wall_time_s"],
                             tokens / result["wall_time_s"]))
                log(f"  {rows[-1][-1]:,.0f} tok/s")
        memory = []
        for lines in (int(n) for n in args.rss_lines.split(",") if n):
            log(f"peak memory: {lines} lines")
            prompts = W.seed000(encode, n_prompts=min(lines, 1000), max_new_tokens=1).prompt_token_ids
            bodies = generate_bodies([prompts[i % len(prompts)] for i in range(lines)], 1)
            result = run_batch(args.rss_model or args.model, bodies, work, engine_flags)
            memory.append((lines, result["peak_rss_mib"], result["wall_time_s"]))
    print("| workload | way | requests | tokens | seconds | tokens/s |\n|---|---|---:|---:|---:|---:|")
    for name, way, requests, tokens, seconds, rate in rows:
        print(f"| {name} | {way} | {requests} | {tokens:,} | {seconds:.2f} | {rate:,.0f} |")
    print("\n| request file lines (max_tokens 1) | peak RSS MiB | seconds |\n|---:|---:|---:|")
    for lines, rss, seconds in memory:
        print(f"| {lines:,} | {rss:,.0f} | {seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
