"""The cost of structured outputs in a decode step: engine step time with `--batch` sequences decoding, each
constrained by a JSON schema, against the same sequences unconstrained, side by side in one process.

Every request samples at temperature 1 (seeded); only steps where all `--batch` sequences decode are timed
(the prefill step and steps after a constrained sequence finished are not). The grammar's share is timed
apart: filling the batch's bitmask (llguidance, in parallel) inside the steps, and applying those bitmasks to
random logits after them.

    python scripts/bench_structured.py --model /work/ckpt/gpt2 [--batch 32 --steps 24 --repeats 3 --threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minigpt import LLM, SamplingParams, StructuredOutputsParams
from minigpt.sampling.bitmask import apply_bitmask
from minigpt.structured import plug

# one long free-text field: random weights stay inside it, so every sequence keeps decoding
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                                           "text": {"type": "string"}},
          "required": ["id", "tags", "text"], "additionalProperties": False}


def timed_steps(llm: LLM, params: SamplingParams, batch: int, steps: int) -> list[float]:
    """Seconds of each step in which all `batch` sequences decode."""
    engine = llm.engine
    requests = [engine.make_request(f"Request {i}: the answer is", params) for i in range(batch)]
    for request in requests:
        engine.add(request)
    engine.step()  # the prompts
    times = []
    while len(times) < steps and all(not r.finished for r in requests):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request in requests:
        engine.abort(request)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    llm = LLM(args.model, num_threads=args.threads)
    engine = llm.engine
    fill_ms: list[float] = []
    bitmasks: list[torch.Tensor] = []
    fill = plug.fill_bitmask

    def timed_fill(states, tokens_left):
        start = time.perf_counter()
        bitmask = fill(states, tokens_left)
        fill_ms.append(1e3 * (time.perf_counter() - start))
        bitmasks.append(bitmask)
        return bitmask

    plug.fill_bitmask = timed_fill  # what GrammarPostprocessor calls in a step with a grammar
    modes = {"none": SamplingParams(max_tokens=args.steps + 2, temperature=1.0, seed=0, ignore_eos=True),
             "json schema": SamplingParams(max_tokens=args.steps + 2, temperature=1.0, seed=0,
                                           structured_outputs=StructuredOutputsParams(json=SCHEMA))}
    timed_steps(llm, modes["json schema"], args.batch, 2)  # compile the grammar, warm both paths
    results: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.repeats):
        for name, params in modes.items():
            results[name] += timed_steps(llm, params, args.batch, args.steps)
    medians = {name: 1e3 * statistics.median(times) for name, times in results.items()}
    logits = torch.randn(args.batch, engine.vocab_limit)
    apply_ms = []
    for bitmask in bitmasks[-args.steps:]:
        start = time.perf_counter()
        apply_bitmask(logits, bitmask)
        apply_ms.append(1e3 * (time.perf_counter() - start))
    print(f"| batch {args.batch}, {torch.get_num_threads()} threads | step ms (median) | steps timed |")
    print("|---|---|---|")
    for name, ms in medians.items():
        print(f"| {name} | {ms:.1f} | {len(results[name])} |")
    print(f"\nratio json/none: {medians['json schema'] / medians['none']:.3f}")
    print(f"bitmask fill (llguidance, batch {args.batch}): {statistics.median(fill_ms):.2f} ms median; "
          f"applying it to [{args.batch}, {engine.vocab_limit}] fp32 logits: {statistics.median(apply_ms):.2f} ms")
    llm.close()


if __name__ == "__main__":
    main()
