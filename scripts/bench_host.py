"""The engine's host time per decode step: everything `Engine.step` does but the model's forward.

    python scripts/bench_host.py                          # batches 1, 64, 256
    python scripts/bench_host.py --batches 1,256 --steps 100 --repeats 7 --json results/host.json
    python scripts/bench_host.py --penalties              # greedy with repetition/presence/frequency penalties
    python scripts/bench_host.py --churn                  # staggered lengths, finished requests replaced
    python scripts/bench_host.py --churn --same-prompts   # ... each repetition's prompts met in the prefix cache

A 1-layer, 64-dim checkpoint with a 1,024-token vocabulary (`--vocab`; random weights, written to a temporary
folder) keeps the model's own time small; the time inside the runner's `run` is measured and taken out. The
sampler's share of the host time is printed beside it: on the CPU its tensor work (the argmax over the
vocabulary) is there too. Each batch decodes `--steps` greedy steps after its prompts are in, `--repeats` times
on fresh requests: the median is printed with the spread, and the CPU class. Before/after: run the same command
with PYTHONPATH at another checkout.

`--device-us D` measures overlap instead: a device stand-in whose step takes D microseconds (the host waits for
it at the launch without overlap; with it, only when it reads the tokens, after laying out the next step), and
prints the wall time a step with `overlap` off and on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import minigpt.engine.engine
from minigpt import LLM, SamplingParams
from minigpt.common import cpu_class
from minigpt.common.transfer import HostCopy
from minigpt.model.checkpoint import preset_config, random_model, write_checkpoint
from minigpt.tokenizer.tokenizer import gpt2_vocab_files

PROMPT_LEN = 8
WARM_STEPS = 8
CHURN_PROMPT_LENS, CHURN_MAX_TOKENS = range(8, 41), range(16, 80)  # --churn: cycled through, staggered
CHURN_NUMBERS = itertools.count()  # --churn's requests, numbered across repetitions
PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)  # --penalties


def tiny_checkpoint(folder: Path, vocab_size: int = 1024) -> Path:
    config = preset_config("gpt2", n_layer=1, n_head=1, n_embd=64, vocab_size=vocab_size)
    return write_checkpoint(random_model(config), folder / "tiny", gpt2_vocab_files())


class Clock:
    """Seconds spent inside `owner.name(...)` since the last `take()`."""

    def __init__(self, owner, name: str) -> None:
        self.seconds = 0.0
        call = getattr(owner, name)

        def timed(*args):
            start = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def timed_steps(llm: LLM, batch: int, steps: int, before_timing=lambda: None, penalties: bool = False) -> float:
    """Wall seconds of `steps` decode steps of `batch` sequences, after their prompts and a few steps more."""
    engine = llm.engine
    params = SamplingParams(max_tokens=WARM_STEPS + steps + 2, ignore_eos=True, temperature=0.0,
                            **(PENALTIES if penalties else {}))
    requests = [engine.make_request([(7 * i + j) % 1000 for j in range(PROMPT_LEN)], params) for i in range(batch)]
    for request in requests:
        engine.add(request)
    while any(seq.num_computed_tokens < PROMPT_LEN for r in requests for seq in r.seqs):
        engine.step()
    for _ in range(WARM_STEPS):
        engine.step()
    before_timing()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    for request in requests:
        engine.abort(request)
    return wall


def churn_steps(llm: LLM, batch: int, steps: int, before_timing=lambda: None, penalties: bool = False,
                same_prompts: bool = False) -> float:
    """Seconds inside `steps` engine steps of `batch` requests of staggered lengths, each finished one replaced
    at once (outside the timing), after enough steps for the lengths to spread. `same_prompts`: the prompts of
    the call before, whose blocks the prefix cache still holds."""
    engine = llm.engine
    numbers = itertools.count() if same_prompts else CHURN_NUMBERS

    def new_request():
        i = next(numbers)
        params = SamplingParams(max_tokens=CHURN_MAX_TOKENS[13 * i % len(CHURN_MAX_TOKENS)], ignore_eos=True,
                                temperature=0.0, **(PENALTIES if penalties else {}))
        length = CHURN_PROMPT_LENS[7 * i % len(CHURN_PROMPT_LENS)]
        # no prompt starts as another does: the prefix cache finds nothing to share
        prompt = [i % 1000, i // 1000 % 1000, *((7 * i + j) % 1000 for j in range(length - 2))]
        request = engine.make_request(prompt, params)
        engine.add(request)
        return request

    live = [new_request() for _ in range(batch)]
    spread = CHURN_MAX_TOKENS[-1]  # untimed steps, the longest output's: for the lengths to spread
    seconds = 0.0
    for step in range(spread + steps):
        if step == spread:
            before_timing()
        start = time.perf_counter()
        engine.step()
        if step >= spread:
            seconds += time.perf_counter() - start
        live = [request if not request.finished else new_request() for request in live]
    for request in live:
        engine.abort(request)
    return seconds


def measure(llm: LLM, model: Clock, sampler: Clock, batch: int, args: argparse.Namespace
            ) -> tuple[float, float, float]:
    """(host, model, sampler) seconds per step of `batch` sequences; host includes the sampler's."""
    def reset() -> None:
        model.take()
        sampler.take()

    if args.churn:
        wall = churn_steps(llm, batch, args.steps, reset, args.penalties, args.same_prompts)
    else:
        wall = timed_steps(llm, batch, args.steps, reset, args.penalties)
    in_model = model.take()
    return (wall - in_model) / args.steps, in_model / args.steps, sampler.take() / args.steps


class DeviceStandIn(HostCopy):
    """A device running one step at a time, each `seconds` long: a step's tokens are ready that long after it
    was launched or after the step before it was done, whichever is later; reading them waits for the rest."""

    seconds = 0.0
    busy_until = 0.0

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor)
        self.ready = DeviceStandIn.busy_until = max(time.perf_counter(), DeviceStandIn.busy_until) + self.seconds

    def tolist(self) -> list:
        time.sleep(max(0.0, self.ready - time.perf_counter()))
        return super().tolist()


def wait_at_launch(runner) -> None:
    """The stand-in's step time spent at the launch: where a step not overlapped waits for it."""
    run = runner.run

    def launch(inputs):
        time.sleep(DeviceStandIn.seconds)
        return run(inputs)

    runner.run = launch


def overlap_walls(llm_args: dict, batches: list[int], args: argparse.Namespace) -> dict:
    """Per batch, median wall microseconds a step with overlap off and on, the device a stand-in."""
    DeviceStandIn.seconds = args.device_us / 1e6
    minigpt.engine.engine.HostCopy = DeviceStandIn
    results: dict = {batch: {} for batch in batches}
    for overlap in ("off", "on"):
        llm = LLM(**llm_args, overlap=overlap)
        if overlap == "off":
            wait_at_launch(llm.engine.runner)
        for batch in batches:
            walls = [timed_steps(llm, batch, args.steps) / args.steps * 1e6 for _ in range(args.repeats)]
            results[batch][f"overlap_{overlap}_us"] = statistics.median(walls)
        llm.close()
    for batch in batches:
        off, on = results[batch]["overlap_off_us"], results[batch]["overlap_on_us"]
        print(f"batch {batch:4d}: a step {off:8.1f} us without overlap, {on:8.1f} us with it "
              f"(device stand-in {args.device_us:.0f} us a step)", flush=True)
    return results


def host_times(llm_args: dict, batches: list[int], args: argparse.Namespace) -> dict:
    llm = LLM(**llm_args, overlap="off")
    model_clock, sampler_clock = Clock(llm.engine.runner, "run"), Clock(llm.engine, "sampler")
    results = {}
    for batch in batches:
        runs = [measure(llm, model_clock, sampler_clock, batch, args) for _ in range(args.repeats)]
        host = sorted(h * 1e6 for h, _, _ in runs)
        model = statistics.median(m * 1e6 for _, m, _ in runs)
        sampler = statistics.median(s * 1e6 for _, _, s in runs)
        results[batch] = {"host_us": statistics.median(host), "host_min_us": host[0], "host_max_us": host[-1],
                          "model_us": model, "sampler_us": sampler}
        print(f"batch {batch:4d}: host {statistics.median(host):8.1f} us a step ({host[0]:.1f}-{host[-1]:.1f}), "
              f"of it the sampler {sampler:7.1f} us; model {model:8.1f} us", flush=True)
    llm.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,64,256", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=100, help="decode steps timed per repetition")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--vocab", type=int, default=1024, help="the checkpoint's vocabulary (gpt2's: 50257)")
    parser.add_argument("--penalties", action="store_true",
                        help=f"greedy with penalties ({', '.join(f'{k}={v}' for k, v in PENALTIES.items())})")
    parser.add_argument("--churn", action="store_true",
                        help="staggered lengths, each finished request replaced: steps that mix prompts and decodes")
    parser.add_argument("--same-prompts", action="store_true",
                        help="with --churn: each repetition sends the last one's prompts again (prefix cache hits)")
    parser.add_argument("--device-us", type=float, default=None,
                        help="measure overlap with a device stand-in taking this long a step")
    args = parser.parse_args(argv)
    if args.churn and args.device_us is not None:
        parser.error("--churn measures host time; --device-us measures overlap on steps of equal lengths")
    if args.same_prompts and not args.churn:
        parser.error("--same-prompts goes with --churn")
    batches = [int(b) for b in args.batches.split(",")]
    logging.getLogger("minigpt").setLevel(logging.ERROR)  # the tiny vocabulary has no EOS id: its warning
    threads = args.threads or torch.get_num_threads()  # the engine gives torch's count back when it closes
    with tempfile.TemporaryDirectory() as folder:
        llm_args = dict(model=str(tiny_checkpoint(Path(folder), args.vocab)), max_num_seqs=max(batches),
                        num_threads=args.threads,
                        kv_cache_tokens=max(batches) * 2 * (
                            CHURN_PROMPT_LENS[-1] + CHURN_MAX_TOKENS[-1] if args.churn
                            else PROMPT_LEN + WARM_STEPS + args.steps + 16))
        if args.device_us is not None:
            results = overlap_walls(llm_args, batches, args)
        else:
            results = host_times(llm_args, batches, args)
    described = cpu_class.describe()
    traffic = " (churn, the same prompts again)" if args.same_prompts else " (churn)" * args.churn
    print(f"CPU class {described}; torch {torch.__version__}, {threads} thread{'s' * (threads != 1)}; "
          f"medians of {args.repeats} x {args.steps} steps{traffic}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu_class": described, "threads": threads, "steps": args.steps,
                                         "repeats": args.repeats, "churn": args.churn,
                                         "same_prompts": args.same_prompts, "batches": results},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
