"""Requests sharing a prompt prefix go to one replica (its prefix cache holds their blocks); a request without a
prompt, or whose replica is far busier than the least loaded, goes to the least loaded."""

from __future__ import annotations

import hashlib

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

PREFIX_CHARS = 256  # requests alike in their first PREFIX_CHARS characters share a replica
IMBALANCE = 8  # requests in flight past the least loaded replica's, beyond which affinity yields to load


def affinity(prefix: str, replica: str) -> bytes:
    """Rendezvous hashing: a prefix's replica moves only when that replica leaves or one joins."""
    return hashlib.blake2b(f"{replica}\0{prefix}".encode(), digest_size=8).digest()


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Ranks the prefix's replica first, the others after it; Serve takes the least loaded of a rank that has room."""

    def initialize_state(self, prefix_chars: int = PREFIX_CHARS, imbalance: int = IMBALANCE) -> None:
        self.prefix_chars, self.imbalance = prefix_chars, imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        prompt = getattr(pending_request.args[0], "prompt", "") if pending_request and pending_request.args else ""
        if not prompt or len(candidate_replicas) < 2:
            return [candidate_replicas]
        prefix = prompt[: self.prefix_chars]
        ranked = sorted(candidate_replicas, key=lambda r: affinity(prefix, r.replica_id.unique_id), reverse=True)
        loads = [self.replica_queue_len_cache.get(r.replica_id) or 0 for r in ranked]
        if loads[0] - min(loads) > self.imbalance:
            return [candidate_replicas]
        return [ranked[:1], ranked[1:]]
