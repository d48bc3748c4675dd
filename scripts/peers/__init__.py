"""Adapters for the engines minigpt is benchmarked against: HF transformers, CTranslate2, llama.cpp.

A library for ``scripts/bench.py``, not a test. Every adapter has the same small interface
(``Peer``), so the bench runs each workload of ``scripts/workloads.py`` on each engine the same way:

    peer = CTranslate2Peer()
    if (why := peer.unavailable_reason()) is not None: print(f"skip {peer.name}: {why}")
    peer.prepare(checkpoint_dir, "int8")                  # convert (cached) + load
    peer.run_batch(prompts_token_ids, max_new_tokens=64)  # -> BatchResult (tok/s)
    peer.run_one_by_one(prompts_token_ids, 64)            # -> BatchResult
    peer.run_stream(prompt_ids, max_new_tokens=128)       # -> StreamResult (TTFT, TPOT)
    peer.run_serving(requests)                            # -> ServingResult (Poisson arrivals)
    peer.close()

Rules every adapter keeps, so the numbers are comparable: greedy decoding; exactly
``max_new_tokens`` tokens per prompt with EOS ignored (random weights emit EOS at random); the
same prompt token ids for all; the same threads (``THREADS``); tokens actually generated are
counted and reported.

minigpt's own adapter is not here: ``scripts/bench.py`` subclasses ``Peer`` for it and adds it to
the list that ``all_peers()`` returns. Each peer is optional: a missing one is skipped with a one-line
reason. How to install them: ``scripts/PERFORMANCE.md``. Conversions are cached under
``checkpoints.peers_dir()``, keyed by the checkpoint's path and its files' sizes and mtimes.
"""

from __future__ import annotations

from .base import Peer, chunks
from .checkpoints import checkpoint_cache_dir, gpt2_decode_bytes, peers_dir
from .ctranslate2 import CTranslate2Peer
from .hf import HFPeer
from .llama_cpp import LlamaCppPeer
from .machine import (
    THREADS,
    OtherLoad,
    cpu_busy,
    device_bandwidth_gbs,
    memory_bandwidth_gbs,
    run_at_cpu_class,
    wait_until_quiet,
)
from .results import (
    BatchResult,
    RequestTiming,
    ServingResult,
    StreamResult,
    median_batch,
    median_stream,
    repeat,
)

__all__ = [
    "THREADS", "BatchResult", "CTranslate2Peer", "HFPeer", "LlamaCppPeer", "OtherLoad", "Peer",
    "RequestTiming", "ServingResult", "StreamResult", "all_peers", "checkpoint_cache_dir", "chunks", "cpu_busy",
    "device_bandwidth_gbs", "gpt2_decode_bytes", "median_batch", "median_stream", "memory_bandwidth_gbs",
    "peers_dir", "repeat", "run_at_cpu_class", "wait_until_quiet",
]


def all_peers() -> list[Peer]:
    """Every peer adapter (minigpt's is added by scripts/bench.py)."""
    return [HFPeer(), CTranslate2Peer(), LlamaCppPeer()]
