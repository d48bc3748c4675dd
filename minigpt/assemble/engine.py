"""The engine an EngineConfig asks for: checkpoint, tokenizer and runner, with its features plugged in."""

from __future__ import annotations

import logging

import torch

from minigpt.assemble.runner import build_runner
from minigpt.beam.plug import plug_beam_search
from minigpt.engine.config import EngineConfig
from minigpt.engine.engine import Engine
from minigpt.model.config import eos_token_ids
from minigpt.model.weights import check_complete, resolve_checkpoint
from minigpt.model.weights_verify import verify_weights
from minigpt.speculative.speculator import plug_speculation
from minigpt.structured.plug import plug_structured_outputs
from minigpt.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("minigpt")


def build_engine(model: str, config: EngineConfig) -> Engine:
    """`model` (a hub id or a checkpoint directory) loaded into an engine; beam search and structured outputs
    are always plugged in, speculation when config.speculative_config asks for it."""
    threads_before = torch.get_num_threads()
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)  # torch's setting: the whole process's
    try:
        path = resolve_checkpoint(model)
        check_complete(path)
        if config.verify_weights:
            verify_weights(path)
        tokenizer = Tokenizer.from_dir(path)
        runner = build_runner(path, config)
    except BaseException:
        torch.set_num_threads(threads_before)  # no engine to give them back on close
        raise
    engine = Engine(config, tokenizer, runner, eos_token_ids(path, runner.model.config), threads_before)
    unreachable = [i for i in engine.eos_token_ids if i >= engine.vocab_limit]
    if unreachable:
        logger.warning(
            "EOS id %s is past the %d ids the tokenizer and the model share: generation never stops on it "
            "(is a tokenizer file that adds it missing from %s?)", unreachable[0], engine.vocab_limit, path,
        )
    try:
        plug_beam_search(engine)
        plug_structured_outputs(engine)
        if config.speculative_config is not None:
            plug_speculation(engine, build_runner)
    except BaseException:
        engine.close()
        raise
    return engine
