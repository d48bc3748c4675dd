"""Beam search plugged into the engine: groups built from BeamSearchParams, their rows taken from each step."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import replace
from operator import attrgetter

import torch

from minigpt.beam.params import BeamSearchParams
from minigpt.beam.search import BeamGroup, advance_all
from minigpt.common.errors import ParamError
from minigpt.engine.engine import Engine
from minigpt.engine.request import Prompt
from minigpt.engine.seams import Step
from minigpt.engine.sequence import Sequence
from minigpt.sampling import SamplingParams

_request_id = attrgetter("request_id")


def plug_beam_search(engine: Engine) -> None:
    beam_postprocessor = BeamPostprocessor(engine)
    engine.inputs.register(BeamSearchParams, functools.partial(make_beam_group, engine, beam_postprocessor.track))
    engine.postprocessors.append(beam_postprocessor)


def make_beam_group(engine: Engine, track: Callable[[BeamGroup], None], prompt: Prompt,
                    params: BeamSearchParams) -> BeamGroup:
    if engine.speculator is not None:
        raise ValueError("beam search does not run with speculative_config yet: start the engine without it")
    params = replace(params)
    # each beam runs as a sequence that never stops by itself: the group decides where beams end
    request = engine.inputs.sampled_request(prompt, SamplingParams(max_tokens=params.max_tokens, ignore_eos=True))
    group = BeamGroup(request, params, engine.eos_token_ids, engine.tokenizer)
    per_beam = group.num_candidates // params.beam_width
    vocab = engine.vocab_limit
    if group.num_candidates > vocab:  # each step ranks num_candidates tokens of every beam
        raise ParamError("BeamSearchParams", "beam_width", f"must be at most {vocab // per_beam} (a step ranks "
                         f"{per_beam} x beam_width of the {vocab} tokens), got {params.beam_width}")
    track(group)
    return group


class BeamPostprocessor:
    """Takes the beams' rows out of a step (one row each: beams never draft) and advances their groups."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.live: weakref.WeakSet[BeamGroup] = weakref.WeakSet()  # the groups built and not finished
        self._lock = threading.Lock()  # groups are built in submitting threads, stepped in the engine's

    def track(self, group: BeamGroup) -> None:
        with self._lock:
            self.live.add(group)

    def acts_on(self, step: Step) -> bool:
        ids = self._live_ids()
        return bool(ids) and not ids.isdisjoint(map(_request_id, step.seqs))

    def __call__(self, step: Step) -> None:
        ids = self._live_ids()
        if not ids:
            return
        beams, rows = step.take(lambda seq: seq.request_id in ids)
        if beams:
            self._advance(beams, step.logits[self.engine.device_rows(rows)])

    def _live_ids(self) -> set[int]:
        if not self.live:
            return set()
        with self._lock:
            for group in [group for group in self.live if group.finished]:
                self.live.discard(group)
            return {group.request_id for group in self.live}

    def _advance(self, beams: list[Sequence], logits: torch.Tensor) -> None:
        """Hand each beam its best next tokens (fp32 log_softmax over the whole vocabulary, as transformers
        takes it); advance the groups that have all theirs."""
        engine = self.engine
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        logprobs[:, engine.vocab_limit :] = -torch.inf
        groups = [engine.requests[beam.request_id] for beam in beams]
        best, ids = logprobs.topk(max(group.num_candidates for group in groups), dim=-1)
        ready = []
        for beam, group, row_best, row_ids in zip(beams, groups, best.cpu(), ids.cpu(), strict=True):
            if group.receive(beam, row_best, row_ids) and group not in ready:
                ready.append(group)
        advance_all(ready, engine.scheduler)
