"""`minigpt perplexity`: a model's perplexity on a text file, as llama.cpp's llama-perplexity measures it.

    minigpt perplexity --model M --file minigpt/demo_model/held_out.txt [--context 256 --stride 128 --dtype ...]

The file is one token stream (after an <|endoftext|>, so its first token is scored too), cut into windows of
--context tokens that start --stride tokens apart (one token less where the stride is the whole window: a
window's first token is the one before the next to score); each token is scored once, in the first window that
holds it after the window's own first token, through the engine's prompt scoring (max_tokens=0 with prompt_logprobs), so
every engine flag (--dtype, --quantize, --kv-cache-dtype, --compile) is measured as it serves.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

from minigpt.cli import OneLineParser, add_engine_arguments, engine_args_from, flag_error_line
from minigpt.common.errors import USER_ERRORS
from minigpt.demo import add_model_argument, model_or_demo
from minigpt.llm import LLM
from minigpt.sampling import SamplingParams

PROG = "python -m minigpt.perplexity"
END_OF_TEXT = "<|endoftext|>"


class Window(NamedTuple):
    begin: int  # the window is ids[begin:end]
    end: int
    first_scored: int  # ids[first_scored:end] are scored in this window


class Result(NamedTuple):
    nll: float  # summed negative log-likelihood, nats
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)


def windows(n_tokens: int, context: int, stride: int) -> list[Window]:
    if context < 2 or not 1 <= stride <= context:
        raise ValueError(f"need context >= 2 and 1 <= stride <= context, got context={context}, stride={stride}")
    if n_tokens < 2:
        raise ValueError("the text is too short to score: it needs at least one token")
    out, begin, scored_to = [], 0, 1
    while scored_to < n_tokens:
        end = min(begin + context, n_tokens)
        out.append(Window(begin, end, max(scored_to, begin + 1)))
        scored_to = end
        begin = min(begin + stride, end - 1)  # a window's first token is never scored: the next one holds it
    return out


def file_ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(END_OF_TEXT) + llm.tokenizer.encode_ordinary(text)


def score(llm: LLM, ids: list[int], context: int, stride: int) -> Result:
    plan = windows(len(ids), context, stride)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    outs = llm.generate([ids[w.begin:w.end] for w in plan], params, progress=False)
    nll, count = 0.0, 0
    for window, out in zip(plan, outs, strict=True):
        for position in range(window.first_scored, window.end):
            nll -= out.prompt_logprobs[position - window.begin].logprob
            count += 1
    return Result(nll, count)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description="A model's perplexity on a text file (llama-perplexity's measure).")
    add_model_argument(parser)
    parser.add_argument("--file", required=True, help="the UTF-8 text to score")
    parser.add_argument("--context", type=int, default=None, help="tokens per window; default: the model's n_positions")
    parser.add_argument("--stride", type=int, default=None, help="tokens between window starts; default: context / 2")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a line")
    add_engine_arguments(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.model = model_or_demo(args.model, prog)
    try:
        text = Path(args.file).read_text(encoding="utf-8")
        with LLM(args.model, **engine_args_from(args)) as llm:
            context = args.context or llm.engine.model_config.n_positions
            if context > llm.engine.model_config.n_positions:
                raise ValueError(f"--context {context} is past the model's n_positions "
                                 f"{llm.engine.model_config.n_positions}")
            stride = args.stride or max(1, context // 2)
            result = score(llm, file_ids(llm, text), context, stride)
    except USER_ERRORS as err:
        print(parser.error_line(flag_error_line(err)), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": args.model, "file": args.file, "context": context, "stride": stride,
                          "tokens": result.tokens, "nll": result.nll, "perplexity": result.perplexity}))
    else:
        print(f"perplexity {result.perplexity:.4f} over {result.tokens} tokens "
              f"(windows of {context} tokens, stride {stride})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
