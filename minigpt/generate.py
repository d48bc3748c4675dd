"""`python -m minigpt.generate`: one --prompt streamed, a --prompts-file batched, or either beam searched."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from minigpt.beam.params import BeamSearchOutput, BeamSearchParams
from minigpt.cli import OneLineParser, add_engine_arguments, engine_args_from, flag_error_line
from minigpt.common.errors import USER_ERRORS, ParamError
from minigpt.common.progress import log_to_stderr
from minigpt.demo import add_model_argument, model_or_demo
from minigpt.engine.request import RequestOutput
from minigpt.llm import LLM
from minigpt.sampling import SamplingParams

PROG = "python -m minigpt.generate"  # the console command passes its own: "minigpt generate"

# the SamplingParams field each sampling flag sets, by the flag's dest
SAMPLING_FLAGS = {
    "max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
    "min_p": "min_p", "repetition_penalty": "repetition_penalty", "seed": "seed", "stop": "stop",
    "ignore_eos": "ignore_eos",
}
BEAM_FLAGS = ("length_penalty", "early_stopping")  # beam search's own flags, besides --beam-width


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description="Generate text with GPT-2.")
    add_model_argument(parser)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompts-file", help="a file with one prompt per line, blank lines skipped ('-' reads stdin)")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", type=int, default=SamplingParams.max_tokens)
    sampling.add_argument("--temperature", type=float, default=SamplingParams.temperature, help="0 = greedy")
    sampling.add_argument("--top-k", type=int, default=SamplingParams.top_k, help="0 = off")
    sampling.add_argument("--top-p", type=float, default=SamplingParams.top_p)
    sampling.add_argument("--min-p", type=float, default=SamplingParams.min_p)
    sampling.add_argument("--repetition-penalty", type=float, default=SamplingParams.repetition_penalty)
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep going past <|endoftext|>")
    beam = parser.add_argument_group("beam search (replaces sampling)")
    beam.add_argument("--beam-width", type=int, default=None, help="beam search with this many beams")
    beam.add_argument("--length-penalty", type=float, default=BeamSearchParams.length_penalty,
                      help="a hypothesis ranks by its logprob / length ** this")
    beam.add_argument("--early-stopping", choices=("false", "true", "never"), default="false",
                      help="true: stop at beam-width finished hypotheses; never: search while one could still win")
    add_engine_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    parser.add_argument("--quiet", action="store_true", help="no engine report or progress on stderr")
    return parser


def read_prompts(args: argparse.Namespace) -> tuple[list[str], list[int] | None]:
    """The prompts, and for a --prompts-file the line number of each (blank lines are skipped)."""
    if args.prompts_file is None:
        return [args.prompt if args.prompt is not None else "Hello, my name is"], None
    if args.prompts_file == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(args.prompts_file, encoding="utf-8-sig") as handle:  # -sig: a byte-order mark is no prompt text
                text = handle.read()
        except OSError as err:
            raise ValueError(f"cannot read --prompts-file: {err.strerror}: {args.prompts_file}") from None
        except UnicodeDecodeError as err:
            raise ValueError(f"--prompts-file {args.prompts_file} is not UTF-8 text (byte {err.start}: "
                             f"{err.reason})") from None
    # Lines end at \n (or \r\n) only: str.splitlines() would also split a prompt at U+2028, form feeds, ...
    lines = [(number, line.removesuffix("\r")) for number, line in enumerate(text.split("\n"), 1)]
    numbered = [(number, line) for number, line in lines if line.strip()]
    if not numbered:
        raise ValueError(f"no prompts in {args.prompts_file}")
    return [line for _, line in numbered], [number for number, _ in numbered]


def as_json(out: RequestOutput) -> str:
    return json.dumps({
        "prompt": out.prompt,
        "prompt_token_ids": out.prompt_token_ids,
        "token_ids": out.token_ids,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "time_to_first_token_s": round(out.metrics.time_to_first_token, 6),
        "time_per_output_token_s": round(out.metrics.time_per_output_token, 6),
    }, ensure_ascii=False)


def beam_as_json(out: BeamSearchOutput) -> str:
    return json.dumps({
        "prompt": out.prompt,
        "prompt_token_ids": out.prompt_token_ids,
        "sequences": [{"token_ids": s.token_ids, "text": s.text, "cumulative_logprob": s.cumulative_logprob,
                       "score": s.score, "finish_reason": s.finish_reason} for s in out.sequences],
    }, ensure_ascii=False)


def given_flags(args: argparse.Namespace, dests) -> list[str]:
    """The flags of `dests` (by dest) given a value other than their default."""
    parser = build_parser()
    return [dest for dest in dests if getattr(args, dest) != parser.get_default(dest)]


def beam_params(args: argparse.Namespace) -> BeamSearchParams:
    """The beam flags as BeamSearchParams; other sampling flags than --max-new-tokens and --ignore-eos refused."""
    for dest in given_flags(args, SAMPLING_FLAGS):
        if dest not in ("max_new_tokens", "ignore_eos"):
            raise ValueError(f"--{dest.replace('_', '-')} does not apply to beam search (--beam-width)")
    early_stopping = {"false": False, "true": True, "never": "never"}[args.early_stopping]
    return BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_new_tokens,
                            length_penalty=args.length_penalty, early_stopping=early_stopping,
                            ignore_eos=args.ignore_eos)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as SamplingParams; the beam search flags refused (no --beam-width)."""
    given = given_flags(args, BEAM_FLAGS)
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} applies to beam search only (add --beam-width)")
    return SamplingParams(**{field: getattr(args, dest) for dest, field in SAMPLING_FLAGS.items()})


def flag_names() -> dict[str, str]:
    dests = {field: dest for dest, field in SAMPLING_FLAGS.items()}
    dests.update({name: name for name in ("beam_width", *BEAM_FLAGS)})
    return {field: f"--{dest.replace('_', '-')}" for field, dest in dests.items()}


def run(args: argparse.Namespace) -> None:
    prompts, line_numbers = read_prompts(args)
    beam = beam_params(args) if args.beam_width is not None else None
    params = sampling_params(args) if beam is None else None
    with LLM(args.model, **engine_args_from(args)) as llm:
        if beam is not None:
            for out in with_line_numbers(lambda: llm.beam_search(prompts, beam), args, line_numbers):
                print(beam_as_json(out) if args.json else out.prompt + out.sequences[0].text, flush=True)
            return
        if len(prompts) == 1 and not args.json:
            deltas = llm.stream(prompts[0], params)  # bad input raises here, before anything is written
            sys.stdout.write(prompts[0])
            for delta in deltas:
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            sys.stdout.flush()  # here, where a reader gone is caught, not at exit
            return
        outs = with_line_numbers(lambda: llm.generate(prompts, params, progress=False if args.quiet else None), args,
                                 line_numbers)
        for out in outs:
            print(as_json(out) if args.json else out.prompt + out.text, flush=True)


def with_line_numbers(complete, args: argparse.Namespace, line_numbers: list[int] | None):
    """complete(), a refused "prompt i: ..." named by its line of the file (no prefix for the one --prompt)."""
    try:
        return complete()
    except ValueError as err:
        index = getattr(err, "prompt_index", None)
        if index is None:
            raise
        cause = err.cause
        where = "" if line_numbers is None else f"line {line_numbers[index]} of {args.prompts_file}: "
        raise cause.at(where) if isinstance(cause, ParamError) else ValueError(where + str(cause)) from None


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.model = model_or_demo(args.model, prog, args.quiet)
    if not args.quiet:
        log_to_stderr(logging.INFO)
    try:
        run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # stdout's reader left (| head): stop quietly, as Unix tools do
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush has nowhere to fail
        except (OSError, ValueError):  # a stdout that is no file descriptor
            pass
        return 128 + signal.SIGPIPE
    except USER_ERRORS as err:
        print(parser.error_line(flag_error_line(err, flag_names())), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
