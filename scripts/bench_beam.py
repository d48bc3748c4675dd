"""Beam search side by side: minigpt (all prompts' beams continuously batched, blocks shared) against
transformers' beam search one prompt at a time and batched (left-padded), in one run.

    python scripts/make_checkpoint.py checkpoints/gpt2-2l --preset gpt2 --n-layer 2
    python scripts/bench_beam.py --model checkpoints/gpt2-2l --beam-width 4 --prompts 32 --max-new-tokens 32

Every engine gets the same prompt token ids (5-40 tokens) and the same beam search (fp32,
length_penalty 1, early_stopping False, EOS as the checkpoint has it). Seconds are medians over
--repeats runs; hypotheses are compared with transformers one prompt at a time. Blocks: the most
KV blocks each request held at once (its beams share their prompt and common prefixes), against
what beam_width separate sequences of the longest hypothesis would hold.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from minigpt import LLM, BeamSearchParams


def log(message: str) -> None:
    print(f"[bench_beam] {message}", flush=True)


def timed(fn, repeats: int):
    seconds, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def hf_one_at_a_time(model, prompts: list[list[int]], params: BeamSearchParams) -> list[list[list[int]]]:
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **hf_args(params))
        lengths = (out.beam_indices >= 0).sum(-1).tolist()
        outs.append([row[len(prompt):len(prompt) + n] for row, n in zip(out.sequences.tolist(), lengths, strict=True)])
    return outs


def hf_batched(model, prompts: list[list[int]], params: BeamSearchParams) -> None:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model.generate(ids, attention_mask=mask, **hf_args(params))


def hf_args(params: BeamSearchParams) -> dict:
    return dict(do_sample=False, num_beams=params.beam_width, num_return_sequences=params.beam_width,
                length_penalty=params.length_penalty, early_stopping=params.early_stopping,
                max_new_tokens=params.max_tokens, pad_token_id=0, return_dict_in_generate=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint directory")
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(50000) for _ in range(rng.randint(5, 40))] for _ in range(args.prompts)]
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_new_tokens)
    log(f"{args.prompts} prompts of 5-40 tokens, beam width {args.beam_width}, {args.max_new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads")

    with LLM(args.model, dtype="float32", block_size=args.block_size, num_threads=args.threads) as llm:
        llm.beam_search(prompts[:2], params)  # warm-up
        peak: dict[int, int] = {}

        def watch(batch, sampled, num_tokens) -> None:
            for request_id, group in llm.engine.beam_groups.items():
                held = len({block for seq in group.seqs for block in seq.block_table})
                peak[request_id] = max(peak.get(request_id, 0), held)

        llm.engine.on_step = watch
        mine_s, outs = timed(lambda: llm.beam_search(prompts, params), args.repeats)
        llm.engine.on_step = None
        log(f"minigpt: {mine_s:.2f} s")
        pool_blocks = llm.kv_cache_info["num_blocks"]
    mine = [[s.token_ids for s in out.sequences] for out in outs]
    held = list(peak.values())[-args.prompts:]
    separate = [args.beam_width * -(-(len(p) + max(map(len, m))) // args.block_size) for p, m in zip(prompts, mine,
                                                                                                       strict=True)]

    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(args.model, dtype=torch.float32).eval()
    with torch.inference_mode():
        one_s, theirs = timed(lambda: hf_one_at_a_time(model, prompts, params), args.repeats)
        log(f"transformers one at a time: {one_s:.2f} s")
        batched_s, _ = timed(lambda: hf_batched(model, prompts, params), args.repeats)
        log(f"transformers batched: {batched_s:.2f} s")

    same = sum(m == t for m, t in zip(mine, theirs, strict=True))
    best = sum(m[0] == t[0] for m, t in zip(mine, theirs, strict=True))
    print("\n| engine | seconds | prompts/s | vs minigpt |\n| --- | --- | --- | --- |")
    for name, seconds in (("minigpt LLM.beam_search", mine_s), ("transformers, one prompt at a time", one_s),
                          ("transformers, batched (left-padded)", batched_s)):
        print(f"| {name} | {seconds:.2f} | {args.prompts / seconds:.2f} | {seconds / mine_s:.2f}x |")
    print(f"\nhypotheses equal to transformers': all {args.beam_width} in order for {same}/{args.prompts} prompts, "
          f"the best for {best}/{args.prompts}")
    print(f"KV blocks ({args.block_size} tokens) held per request at most: mean {statistics.mean(held):.1f}, "
          f"max {max(held)}; {args.beam_width} separate sequences: mean {statistics.mean(separate):.1f}, "
          f"max {max(separate)} (pool: {pool_blocks} blocks)")


if __name__ == "__main__":
    main()
