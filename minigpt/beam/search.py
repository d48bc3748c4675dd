"""A beam-search request: live beams run as ordinary decodes, and the hypotheses they finish.

Each step picks the next beams as transformers' `_beam_search` does (same candidates, same tensor ops,
so the same ties). A beam picked twice is forked, its blocks shared and copied on write.
"""

from __future__ import annotations

import time

import torch

from minigpt.beam.params import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from minigpt.engine.request import CompletionOutput, Request, RequestMetrics, RequestOutput
from minigpt.engine.scheduler import Scheduler
from minigpt.engine.sequence import Sequence
from minigpt.tokenizer.tokenizer import Tokenizer

NEG = -1.0e9  # transformers' score of an impossible beam


class BeamGroup:
    """The live beams and the best finished hypotheses of one prompt; nothing streams until it ends."""

    streams = False

    def __init__(self, request: Request, params: BeamSearchParams, eos_token_ids: tuple[int, ...],
                 tokenizer: Tokenizer) -> None:
        k = params.beam_width
        self.tokenizer = tokenizer
        self.stats = request.seqs[0].stats  # the prompt's: arrival, first scheduled, first token
        self.request_id, self.prompt = request.request_id, request.prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params = params
        # transformers runs num_beams=1 as greedy search, which is beam search that stops at the first EOS
        self.early_stopping = True if k == 1 else params.early_stopping
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos)) * k
        # beams 1.. start as copies of the prompt that score NEG, as in transformers: only beam 0 spreads
        self.beams: list[Sequence] = [request.seqs[0]] * k
        self.scores = torch.full((k,), NEG)
        self.scores[0] = 0.0
        # id(beam) -> its num_candidates best next tokens: (logprobs, ids), best first
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.finished_scores = torch.full((k,), NEG)
        self.finished_flags = torch.zeros(k, dtype=torch.bool)
        self.hypotheses: list[tuple[list[int], float] | None] = [None] * k  # (generated ids, cumulative logprob)
        self.improvable = True
        self.done = False

    @property
    def seqs(self) -> list[Sequence]:
        return [] if self.done else list({id(beam): beam for beam in self.beams}.values())

    @property
    def finished(self) -> bool:
        return self.done or any(seq.finished for seq in self.seqs)

    def receive(self, beam: Sequence, logprobs: torch.Tensor, token_ids: torch.Tensor) -> bool:
        """Store a beam's best next tokens (on the CPU); True once every live beam has its own."""
        self.pending[id(beam)] = logprobs[: self.num_candidates], token_ids[: self.num_candidates]
        return all(id(beam) in self.pending for beam in self.beams)

    def advance(self, top_scores: torch.Tensor, parents: list[int], tokens: list[int], scheduler: Scheduler) -> None:
        """One step from the best continuations of all beams: offer finished hypotheses, then extend the beams."""
        k, es, lp, max_tokens = self.params.beam_width, self.early_stopping, self.params.length_penalty, \
            self.params.max_tokens
        self.pending.clear()
        length = len(self.beams[0].output_token_ids) + 1  # generated tokens, this step's included
        hits = torch.tensor([t in self.eos or length >= max_tokens for t in tokens])

        running_scores = top_scores + hits.to(torch.float32) * NEG
        survivors = torch.topk(running_scores, k)[1].tolist()
        self._offer(top_scores, hits, parents, tokens, length)
        self.scores = running_scores[survivors]

        best_length = max_tokens if es == "never" and lp > 0.0 else length
        best_possible = self.scores[:1] / (best_length**lp)
        worst_finished = torch.where(self.finished_flags, self.finished_scores.min(), NEG)
        self.improvable = self.improvable and bool(torch.any(best_possible > worst_finished))
        full = bool(self.finished_flags.all()) and es is True
        if not self.improvable or full or bool(hits.all()):
            for beam in self.seqs:
                self._drop(beam, scheduler)
            self.done = True
            self.stats.finished = time.perf_counter()
            return
        self._extend([(self.beams[parents[i]], tokens[i]) for i in survivors], scheduler)

    def _offer(self, top_scores: torch.Tensor, hits: torch.Tensor, parents: list[int], tokens: list[int],
               length: int) -> None:
        k, lp = self.params.beam_width, self.params.length_penalty
        just_finished = hits.clone()
        just_finished[k:] = False
        scores = top_scores / (length**lp)
        scores += float(bool(self.finished_flags.all()) and self.early_stopping is True) * NEG
        scores += float(not self.improvable) * NEG
        scores += (~just_finished) * NEG
        merged = torch.topk(torch.cat((self.finished_scores, scores)), k)[1].tolist()
        cumulative = top_scores.tolist()
        hypotheses = []
        for i in merged:
            if i < k:
                hypotheses.append(self.hypotheses[i])
            else:
                c = i - k
                hypotheses.append((self.beams[parents[c]].output_token_ids + [tokens[c]], cumulative[c]))
        self.hypotheses = hypotheses
        self.finished_scores = torch.cat((self.finished_scores, scores))[merged]
        self.finished_flags = torch.cat((self.finished_flags, just_finished))[merged]

    def _extend(self, picks: list[tuple[Sequence, int]], scheduler: Scheduler) -> None:
        """A parent's first pick continues it, a later one forks it; parents not picked are pruned."""
        continued: set[int] = set()
        beams = []
        for parent, _ in picks:
            if id(parent) in continued:
                child = parent.fork(scheduler.blocks.fork(parent.block_table))
                scheduler.add_fork(parent, child)
                beams.append(child)
            else:
                continued.add(id(parent))
                beams.append(parent)
        for beam in self.seqs:
            if id(beam) not in continued:
                self._drop(beam, scheduler)
        for beam, (_, token) in zip(beams, picks, strict=True):
            beam.append(token)
        self.beams = beams

    @staticmethod
    def _drop(beam: Sequence, scheduler: Scheduler) -> None:
        beam.abort()
        scheduler.finish(beam)

    def output(self) -> BeamSearchOutput:
        tokenizer = self.tokenizer
        sequences = []
        for hypothesis, score in zip(self.hypotheses, self.finished_scores.tolist(), strict=True):
            if hypothesis is None:  # fewer hypotheses than beams: a vocabulary smaller than 2 * beam_width
                continue
            token_ids, cumulative = hypothesis
            reason = "stop" if token_ids[-1] in self.eos else "length"
            sequences.append(BeamSearchSequence(token_ids, tokenizer.decode(token_ids), cumulative, score, reason))
        return BeamSearchOutput(self.request_id, self.prompt, self.prompt_token_ids, sequences)

    def request_output(self) -> RequestOutput:
        """The hypotheses as completions, best first (aborted or failed: one empty completion saying so)."""
        if self.done:
            outputs = [CompletionOutput(i, s.token_ids, s.text, s.finish_reason)
                       for i, s in enumerate(self.output().sequences)]
        else:
            reason = next((seq.finish_reason for seq in self.seqs if seq.finished), "abort")
            outputs = [CompletionOutput(0, [], "", reason)]
        metrics = RequestMetrics(*self.stats.latencies(len(outputs[0].token_ids)), 0)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, metrics)


def advance_all(groups: list[BeamGroup], scheduler: Scheduler) -> None:
    """Advance groups that have every beam's best tokens: one batched top-k per (width, candidates)."""
    by_shape: dict[tuple[int, int], list[BeamGroup]] = {}
    for group in groups:
        by_shape.setdefault((group.params.beam_width, group.num_candidates), []).append(group)
    for (k, n), same in by_shape.items():
        best = [group.pending[id(beam)] for group in same for beam in group.beams]
        logprobs = torch.stack([lp for lp, _ in best]).view(len(same), k, n)
        token_ids = torch.stack([ids for _, ids in best]).view(len(same), k * n)
        scores = torch.stack([group.scores for group in same])  # [G, k]
        top_scores, flat = torch.topk((logprobs + scores[:, :, None]).view(len(same), k * n), n)
        parents, tokens = (flat // n).tolist(), token_ids.gather(1, flat).tolist()
        for i, group in enumerate(same):
            group.advance(top_scores[i], parents[i], tokens[i], scheduler)
