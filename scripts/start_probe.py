"""Start one engine in this fresh process, generate a few tokens, print JSON {start_s, peak_rss_mb}.

    python scripts/start_probe.py --engine minigpt --mode w8a8+compile+kv-float16 --model checkpoints/gpt2-random

start_s: from this script's first line to the engine ready to generate (imports, loading the
checkpoint, any conversion, compile or cache load); peak_rss_mb: this process's peak resident memory
(VmHWM) after the engine has generated a few tokens. scripts/bench.py runs it once per start it reports, so
that nothing is warm from an engine run earlier in the same process.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402 - the clock starts before anything is imported
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = list(range(1, 9))  # token ids every GPT-2 vocabulary has
NEW_TOKENS = 8


def peer_named(engine: str):
    """The bench's adapter for `engine`; minigpt's (and torch) imported only for minigpt."""
    if engine == "minigpt":
        from bench import MinigptPeer

        return MinigptPeer()
    import peers

    for peer in peers.all_peers():
        if peer.name == engine:
            return peer
    raise SystemExit(f"--engine: no engine {engine!r}")


def probe(engine: str, mode: str, model: str) -> dict[str, float]:
    peer = peer_named(engine)
    peer.prepare(model, mode)
    start_s = time.perf_counter() - START
    peer.run_stream(PROMPT, NEW_TOKENS)
    peak_rss_mb = peak_rss_kib() / 1024
    peer.close()
    return {"start_s": start_s, "peak_rss_mb": peak_rss_mb}


def peak_rss_kib() -> float:
    """This process's peak resident memory. Linux's VmHWM is this program's own; ru_maxrss keeps the
    peak of the process that forked it (the bench) across exec, so it is only the fallback."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", required=True, help="minigpt, transformers, ctranslate2 or llama.cpp")
    parser.add_argument("--mode", required=True, help="one of the engine's bench modes (float32, w8a8+compile, q8_0)")
    parser.add_argument("--model", required=True, help="a local GPT-2 checkpoint directory")
    args = parser.parse_args(argv)
    print(json.dumps(probe(args.engine, args.mode, args.model)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
