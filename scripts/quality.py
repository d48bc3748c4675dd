"""The quality table of docs/quality.md: the demo model's (or any checkpoint's) perplexity on a held-out file in
each engine mode against transformers float32 on the same weights (and CTranslate2 float32 / int8, llama.cpp f32 /
q8_0 where they are installed), and each mode's greedy agreement with float32.

    python scripts/quality.py [--model DIR] [--file minigpt/demo_model/held_out.txt]

Greedy agreement: the share of generated positions whose token equals float32's, over PROMPTS.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

from minigpt import LLM, SamplingParams
from minigpt.demo import DEMO_MODEL
from minigpt.perplexity import END_OF_TEXT, Result, windows
from minigpt.perplexity import score as engine_score

MODES = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "float16": {"dtype": "float16"},
    "int8": {"quantize": "int8"},
    "w8a8": {"quantize": "w8a8"},
    "KV cache float16": {"kv_cache_dtype": "float16"},
    "KV cache bfloat16": {"kv_cache_dtype": "bfloat16"},
    "fast mode (w8a8, compiled, KV float16)": {"quantize": "w8a8", "compile": True, "kv_cache_dtype": "float16"},
}
PROMPTS = ["The ", "A function is", "When the", "In Python, a class", "If the value", "This module provides",
           "The following example", "An exception"]


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    same = sum(a == b for ref, out in zip(reference, other, strict=True) for a, b in zip(ref, out, strict=False))
    return same / sum(len(ref) for ref in reference)


@torch.no_grad()
def transformers_score(model_dir: str, ids: list[int], context: int, stride: int) -> Result:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for window in windows(len(ids), context, stride):
        chunk = torch.tensor([ids[window.begin:window.end]])
        logprobs = torch.log_softmax(model(chunk).logits[0].float(), dim=-1)
        for position in range(window.first_scored, window.end):
            nll -= logprobs[position - window.begin - 1, ids[position]].item()
            count += 1
    return Result(nll, count)


def ctranslate2_score(model_dir: str, ids: list[int], context: int, stride: int, quantization: str) -> Result | None:
    """CTranslate2 on the same checkpoint, converted here; None where ctranslate2 is not installed."""
    try:
        import ctranslate2
        from ctranslate2.converters import TransformersConverter
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as converted:
        TransformersConverter(model_dir).convert(converted, quantization=quantization, force=True)
        generator = ctranslate2.Generator(converted, device="cpu", compute_type=quantization, intra_threads=1)
        vocabulary = json.loads((Path(converted) / "vocabulary.json").read_text("utf-8"))  # token strings by id
        plan = windows(len(ids), context, stride)
        results = generator.score_batch([[vocabulary[i] for i in ids[w.begin:w.end]] for w in plan])
    nll, count = 0.0, 0
    for window, result in zip(plan, results, strict=True):
        for position in range(window.first_scored, window.end):
            nll -= result.log_probs[position - window.begin - 1]  # log_probs[j]: token j + 1 given the ones before
            count += 1
    return Result(nll, count)


def llama_cpp_score(model_dir: str, ids: list[int], context: int, stride: int, outtype: str) -> Result | None:
    """llama.cpp on the same checkpoint, converted to GGUF here (scripts/PERFORMANCE.md says how to build it);
    None where it is not built."""
    import numpy as np
    from peers.llama_cpp_build import convert_to_gguf, import_llama_cpp

    try:
        lib = import_llama_cpp()
        gguf = convert_to_gguf(model_dir, outtype)
    except (ImportError, RuntimeError):
        return None
    model = lib.Llama(model_path=str(gguf), n_ctx=context, logits_all=True, n_threads=1, verbose=False)
    nll, count = 0.0, 0
    for window in windows(len(ids), context, stride):
        model.reset()
        model.eval(ids[window.begin:window.end])
        logits = np.asarray(model.scores[:window.end - window.begin], dtype=np.float64)
        logprobs = torch.log_softmax(torch.from_numpy(logits), dim=-1)
        for position in range(window.first_scored, window.end):
            nll -= logprobs[position - window.begin - 1, ids[position]].item()
            count += 1
    model.close()
    return Result(nll, count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEMO_MODEL)
    parser.add_argument("--file", default=f"{DEMO_MODEL}/held_out.txt")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--stride", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32, help="generated tokens per prompt")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    text = open(args.file, encoding="utf-8").read()
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows, reference = [], None
    for name, engine_args in MODES.items():
        with LLM(args.model, num_threads=1, **engine_args) as llm:
            ids = llm.tokenizer.encode(END_OF_TEXT) + llm.tokenizer.encode_ordinary(text)
            result = engine_score(llm, ids, args.context, args.stride)
            tokens = [out.token_ids for out in llm.generate(PROMPTS, greedy, progress=False)]
        reference = reference or tokens
        rows.append((name, result.perplexity, agreement(reference, tokens)))
    hf = transformers_score(args.model, ids, args.context, args.stride)
    peers = [(f"CTranslate2 {kind}", ctranslate2_score(args.model, ids, args.context, args.stride, kind))
             for kind in ("float32", "int8")]
    peers += [(f"llama.cpp {kind}", llama_cpp_score(args.model, ids, args.context, args.stride, kind))
              for kind in ("f32", "q8_0")]
    base = rows[0][1]
    print(f"{result.tokens} tokens, windows of {args.context}, stride {args.stride}; "
          f"greedy over {len(PROMPTS)} prompts x {args.max_tokens} tokens\n")
    print("| mode | perplexity | vs minigpt float32 | greedy agreement with float32 |")
    print("|---|---|---|---|")
    print(f"| transformers float32 | {hf.perplexity:.4f} | {hf.perplexity / base - 1:+.4%} | |")
    for name, ppl, agree in rows:
        print(f"| minigpt {name} | {ppl:.4f} | {ppl / base - 1:+.4%} | {agree:.1%} |")
    for name, result in peers:
        if result is None:
            print(f"| {name} | not installed (scripts/PERFORMANCE.md, peers) | | |")
        else:
            print(f"| {name} | {result.perplexity:.4f} | {result.perplexity / base - 1:+.4%} | |")
    return 0 if math.isfinite(base) else 1


if __name__ == "__main__":
    sys.exit(main())
