"""xgrammar against llguidance on GPT-2's vocabulary, on this CPU: the numbers behind minigpt's choice of
structured-output library (scripts/PERFORMANCE.md, "Measurements behind choices in the code").

For each library: the tokenizer info built from minigpt's tokenizer (token bytes per id, EOS 50256); the
first compile of a JSON schema, a regex and a choice list (up to the first mask); the mean time to fill one
row's token mask while a valid output is fed token by token; and applying a [32, 50257] bitmask to fp32
logits (the library's function, and minigpt's torch one). Medians over `--repeats`.

    python scripts/bench_grammar_libs.py --model /work/ckpt/gpt2 [--repeats 5 --threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from minigpt.sampling.bitmask import apply_bitmask
from minigpt.structured.grammar import _TokenizerView as TokenizerView
from minigpt.tokenizer.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                        "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "tags", "address"],
}
SCHEMA_TEXT = '{"name":"Ada Lovelace","age":36,"tags":["a","c"],"address":{"city":"London","zip":"12345"}}'
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4} \((home|work|mobile)\)"
REGEX_TEXT = "555-123-4567 (mobile)"
CHOICES = ["positive", "negative", "neutral", "mixed feelings", "no opinion at all"]
CHOICE_TEXT = "mixed feelings"
BATCH = 32


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


class XGrammar:
    name = "xgrammar 0.2.8"

    def __init__(self, tokenizer: Tokenizer, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        vocab = [b"" if i == tokenizer.eos_token_id else tokenizer.decode_bytes([i]) for i in range(tokenizer.n_vocab)]
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=tokenizer.n_vocab,
                                      stop_token_ids=[tokenizer.eos_token_id])
        self.threads = threads

    def compile(self, kind: str, spec) -> object:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        if kind == "json":
            compiled = compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":"))
        elif kind == "regex":
            compiled = compiler.compile_regex(spec)
        else:
            compiled = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
        matcher = self.xgr.GrammarMatcher(compiled)
        matcher.fill_next_token_bitmask(self.xgr.allocate_token_bitmask(1, self.info.vocab_size))
        return compiled

    def matcher(self, compiled) -> object:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance:
    name = "llguidance 1.9.1"

    def __init__(self, tokenizer: Tokenizer, threads: int) -> None:
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(TokenizerView(tokenizer)))
        self.executor = llguidance.LLExecutor(threads)

    def compile(self, kind: str, spec) -> object:
        m = self.llg.LLMatcher
        if kind == "json":
            grammar = m.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = m.grammar_from_regex(spec)
        else:
            grammar = m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        matcher = m(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        self.llg.torch.fill_next_token_bitmask(matcher, self.llg.torch.allocate_token_bitmask(1, 50257))
        return grammar

    def matcher(self, compiled) -> object:
        return self.llg.LLMatcher(self.tokenizer, compiled, log_level=0)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.llg.torch.apply_token_bitmask_inplace(logits, bitmask)


def measure(lib, tokenizer: Tokenizer, repeats: int) -> dict[str, float]:
    row: dict[str, float] = {}
    cases = {"json": (SCHEMA, SCHEMA_TEXT), "regex": (REGEX, REGEX_TEXT), "choice": (CHOICES, CHOICE_TEXT)}
    for kind, (spec, text) in cases.items():
        row[f"compile {kind} ms"] = 1e3 * statistics.median(timed(lambda k=kind, s=spec: lib.compile(k, s))[0]
                                                            for _ in range(repeats))
        compiled = lib.compile(kind, spec)
        tokens = tokenizer.encode(text) + [tokenizer.eos_token_id]
        bitmask = torch.zeros(1, (tokenizer.n_vocab + 31) // 32, dtype=torch.int32)
        per_token = []
        for _ in range(repeats):
            matcher = lib.matcher(compiled)
            total = 0.0
            for t in tokens:
                total += timed(lambda m=matcher, b=bitmask: lib.fill(m, b, 0))[0]
                assert lib.accept(matcher, t), (lib.name, kind, t)
            per_token.append(total / len(tokens))
        row[f"mask {kind} us/token"] = 1e6 * statistics.median(per_token)
    logits = torch.randn(BATCH, tokenizer.n_vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (BATCH, (tokenizer.n_vocab + 31) // 32), dtype=torch.int32)
    lib.apply(logits.clone(), bitmask)  # warm (llguidance's is torch.compile'd)
    row["apply b32 ms"] = 1e3 * statistics.median(timed(lambda: lib.apply(logits.clone(), bitmask))[0]
                                                  for _ in range(repeats))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint directory (its tokenizer is used)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_dir(args.model)
    rows = {}
    for cls in (XGrammar, LLGuidance):
        seconds, lib = timed(lambda cls=cls: cls(tokenizer, args.threads))
        rows[lib.name] = {"tokenizer info ms": 1e3 * seconds, **measure(lib, tokenizer, args.repeats)}
    logits = torch.randn(BATCH, tokenizer.n_vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (BATCH, (tokenizer.n_vocab + 31) // 32), dtype=torch.int32)
    ours = statistics.median(timed(lambda: apply_bitmask(logits, bitmask))[0] for _ in range(args.repeats))
    columns = list(next(iter(rows.values())))
    print("| library | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.1f}" for c in columns) + " |")
    print(f"\nminigpt.sampling.bitmask.apply_bitmask, [{BATCH}, {tokenizer.n_vocab}] fp32: {1e3 * ours:.2f} ms")


if __name__ == "__main__":
    main()
