"""Replay a serving workload against any OpenAI-compatible /v1/completions endpoint; print latency.

    python -m minigpt.serve --model gpt2 &
    python scripts/load_test.py --rate 4 --num-requests 64
    python scripts/load_test.py --url http://other-host:8000/v1/completions --model gpt2   # same workload

Requests arrive as a Poisson process at --rate per second. Prompts are mostly short with a long tail
(text of common English words, about one GPT-2 token each), outputs of mixed length; one --seed gives
the same requests at every rate and against every server. Each request streams (greedy unless
--temperature), so the client measures time to first token (TTFT: send -> first text chunk) and time
per output token (TPOT: first -> last chunk over the tokens after the first; token counts come from
the stream's usage chunk). The run is bounded by --num-requests and --max-duration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass

import httpx
from workloads import percentile  # scripts/ is on sys.path when this file runs

WORDS = """the of and to in is that for it as was with be by on not he this are or his from at which but have an they
you were her she there one all we their has been would will more if no when what so who said about out up them some
could into than other time only new its then these two may first any like now my such over our man me even most made
after also did many before must through back years where much your way well down should because each just those people
how too little state good very make world still own see men work long get here between both life being under never day
same another know while last might us great old year off come since against go came right used take three small large
city house water light music river garden morning evening window table letter story market winter summer
history""".split()


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt: str
    max_tokens: int


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tpot_s: float | None = None


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def make_workload(args: argparse.Namespace) -> list[Request]:
    """Poisson arrivals; the same seed gives the same prompts and lengths at any rate."""
    rng = random.Random(args.seed)
    requests, t = [], 0.0
    for _ in range(args.num_requests):
        lo, hi = args.long_prompt_words if rng.random() < args.long_fraction else args.prompt_words
        words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
        requests.append(Request(t / args.rate, " ".join(words).capitalize(), rng.randint(*args.output_tokens)))
        t += rng.expovariate(1.0)
    return requests


async def send(client: httpx.AsyncClient, args: argparse.Namespace, model: str, request: Request) -> Result:
    """One streamed completion, timed from the moment it is sent."""
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True,
            "temperature": args.temperature, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension, also minigpt's
    result, chunks, last = Result(), 0, None
    start = time.perf_counter()
    try:
        async with client.stream("POST", args.url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    result.error = "stream error"
                    return result
                if any(c.get("text") for c in event.get("choices", [])):
                    last = time.perf_counter()
                    chunks += 1
                    if result.ttft_s is None:
                        result.ttft_s = last - start
                if event.get("usage"):
                    result.prompt_tokens = event["usage"]["prompt_tokens"]
                    result.completion_tokens = event["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        result.error = type(err).__name__
        return result
    result.ok, result.latency_s = True, time.perf_counter() - start
    result.completion_tokens = result.completion_tokens or chunks  # a server without usage: ~a token a chunk
    if last is not None and result.completion_tokens > 1:
        result.tpot_s = (last - start - result.ttft_s) / (result.completion_tokens - 1)
    return result


async def replay(args: argparse.Namespace, workload: list[Request]) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as client:
        model = args.model or await served_model(client, args.url)
        start = time.perf_counter()
        deadline = start + args.max_duration
        tasks: list[asyncio.Task[Result]] = []
        for request in workload:
            wait = start + request.arrival_s - time.perf_counter()
            if start + request.arrival_s > deadline:
                break
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(send(client, args, model, request)))
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()  # closes its connection: the server cancels the request
        await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.perf_counter() - start
        results = [t.result() if t in done else Result(error="unfinished at --max-duration") for t in tasks]
        return results, elapsed


async def served_model(client: httpx.AsyncClient, url: str) -> str:
    """The first model the server lists (its /v1/models next to /v1/completions)."""
    response = await client.get(url.rsplit("/completions", 1)[0] + "/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def summarize(results: list[Result], elapsed: float, num_planned: int) -> dict:
    ok = [r for r in results if r.ok]
    summary: dict = {
        "requests_planned": num_planned,
        "requests_sent": len(results),
        "requests_ok": len(ok),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "duration_s": round(elapsed, 3),
        "request_throughput_per_s": round(len(ok) / elapsed, 3) if elapsed else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "completion_tokens": sum(r.completion_tokens for r in ok),
    }
    summary["output_tokens_per_s"] = round(summary["completion_tokens"] / elapsed, 1) if elapsed else 0.0
    for name, values in (("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]),
                         ("tpot", [r.tpot_s for r in ok if r.tpot_s is not None]),
                         ("latency", [r.latency_s for r in ok])):
        for q in (50, 99):
            summary[f"{name}_p{q}_ms"] = round(percentile(values, q) * 1000, 2)
    return summary


def report(s: dict) -> str:
    return "\n".join([
        f"requests   {s['requests_sent']}/{s['requests_planned']} sent, {s['requests_ok']} ok, errors {s['errors']}",
        f"duration   {s['duration_s']:.2f} s, {s['request_throughput_per_s']:.2f} req/s",
        f"tokens     {s['prompt_tokens']} prompt, {s['completion_tokens']} completion, "
        f"{s['output_tokens_per_s']:.1f} output tok/s",
        f"TTFT       p50 {s['ttft_p50_ms']:.1f} ms   p99 {s['ttft_p99_ms']:.1f} ms",
        f"TPOT       p50 {s['tpot_p50_ms']:.1f} ms   p99 {s['tpot_p99_ms']:.1f} ms",
        f"latency    p50 {s['latency_p50_ms']:.1f} ms   p99 {s['latency_p99_ms']:.1f} ms",
    ])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1/completions", help="the completions endpoint")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key ($OPENAI_API_KEY)")
    parser.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-words", type=span, default=(5, 40), help="short prompts: words LO:HI")
    parser.add_argument("--long-prompt-words", type=span, default=(100, 300), help="long prompts: words LO:HI")
    parser.add_argument("--long-fraction", type=float, default=0.3, help="share of long prompts")
    parser.add_argument("--output-tokens", type=span, default=(16, 128), help="max_tokens LO:HI")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension): full lengths")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--max-duration", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rate <= 0 or args.num_requests < 1 or args.max_duration <= 0:
        print("load_test: error: --rate and --max-duration must be > 0, --num-requests >= 1", file=sys.stderr)
        return 2
    workload = make_workload(args)
    try:
        results, elapsed = asyncio.run(replay(args, workload))
    except httpx.HTTPError as err:
        print(f"load_test: error: cannot reach the server: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    summary = summarize(results, elapsed, len(workload))
    print(json.dumps(summary) if args.json else report(summary))
    return 0 if summary["requests_ok"] == len(workload) else 1


if __name__ == "__main__":
    sys.exit(main())
