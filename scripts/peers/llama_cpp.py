"""llama.cpp as a peer, through its C API, with the continuous batching llama-server does."""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .base import Peer
from .llama_cpp_build import batched_bench, convert_to_gguf, import_llama_cpp, quantize_gguf
from .machine import THREADS
from .results import BatchResult, RequestTiming, ServingResult, StreamResult


@dataclass
class _Seq:
    """One sequence inside the llama.cpp driver."""

    idx: int
    prompt: list[int]
    max_new: int
    arrival_s: float
    seq_id: int = -1
    n_prefilled: int = 0
    out: list[int] = field(default_factory=list)
    first_s: float = float("nan")
    finish_s: float = float("nan")


class _Batch:
    """A ``llama_batch`` over numpy buffers, so it is filled with array writes instead of per-token ctypes."""

    def __init__(self, lib: Any, capacity: int) -> None:
        import numpy as np

        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self._seq_ptrs = (i32p * capacity)(*[ctypes.cast(base + 4 * i, i32p) for i in range(capacity)])
        self.struct = lib.llama_batch()
        self.struct.token = self.token.ctypes.data_as(i32p)
        self.struct.embd = None
        self.struct.pos = self.pos.ctypes.data_as(i32p)
        self.struct.n_seq_id = self.n_seq_id.ctypes.data_as(i32p)
        self.struct.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32p))
        self.struct.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.n = 0

    def add(self, tokens: Sequence[int], pos0: int, seq_id: int, want_last_logits: bool) -> None:
        k = len(tokens)
        sl = slice(self.n, self.n + k)
        self.token[sl] = tokens
        self.pos[sl] = range(pos0, pos0 + k)
        self.seq[sl] = seq_id
        self.logits[sl] = 0
        self.logits[self.n + k - 1] = 1 if want_last_logits else 0
        self.n += k


class LlamaCppPeer(Peer):
    """llama.cpp through its C API (``llama_cpp`` ctypes bindings), driven with continuous batching.

    One ``llama_decode`` per step holds the next token of every running sequence plus prompt
    chunks of newly admitted ones (as llama-server schedules its slots); each sequence has a KV stream
    of its own (one shared cache with ``kv_unified``) and leaves it as soon as it has its tokens.
    Greedy = argmax of the logits rows.
    """

    name = "llama.cpp"
    dtypes = ("float32", "bfloat16", "q8_0", "q4_0")
    _OUTTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "q8_0": "q8_0"}  # the converter's
    _QUANTIZED = ("q4_0",)  # made from the f32 file by llama.cpp's quantizer

    def __init__(self, n_batch: int = 2048, n_ubatch: int = 512, kv_unified: bool = False) -> None:
        super().__init__()
        self.kv_unified = kv_unified
        self.lib: Any = None
        self.model: Any = None
        self.gguf: Path | None = None
        self.n_vocab = 0
        self.n_batch = n_batch
        self.n_ubatch = n_ubatch

    def unavailable_reason(self) -> str | None:
        try:
            import_llama_cpp()
        except Exception as e:  # a missing or mismatched shared library raises OSError, not ImportError
            return f"llama.cpp bindings unavailable ({e})"
        return None

    def convert(self, checkpoint_dir: str | Path, dtype: str) -> Path:
        if dtype in self._QUANTIZED:
            return quantize_gguf(checkpoint_dir, dtype)
        return convert_to_gguf(checkpoint_dir, self._OUTTYPE[dtype])

    def prepare(self, checkpoint_dir: str | Path, dtype: str) -> None:
        self.close()
        self.lib = import_llama_cpp()
        self.checkpoint_dir = Path(checkpoint_dir)
        self.dtype = dtype
        self.gguf = self.convert(checkpoint_dir, dtype)
        lib = self.lib
        lib.llama_backend_init()
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(str(self.gguf).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {self.gguf}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))

    def _context(self, n_ctx: int, n_seq: int) -> Any:
        """A context with ``n_seq`` KV streams of ``n_ctx / n_seq`` cells each.

        Not unified: with one shared cache every token attends over all cells of all sequences
        (masked), which makes a step O(batch x total tokens); separate streams keep it O(own length).
        """
        lib = self.lib
        cp = lib.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = self.n_batch
        cp.n_ubatch = self.n_ubatch
        cp.n_seq_max = n_seq
        cp.n_threads = THREADS
        cp.n_threads_batch = THREADS
        cp.kv_unified = self.kv_unified
        cp.no_perf = True
        ctx = lib.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        return ctx

    def _drive(self, seqs: list[_Seq], n_parallel: int, realtime: bool) -> tuple[float, int]:
        """Run every sequence to its max_new tokens; returns (seconds, llama_decode calls).

        ``realtime``: sequences are admitted only once their arrival time has passed.
        """
        import numpy as np

        lib = self.lib
        n_parallel = max(1, min(n_parallel, len(seqs), 256))
        longest = -(-max(len(s.prompt) + s.max_new for s in seqs) // 256) * 256
        ctx = self._context(n_parallel * longest, n_parallel)
        mem = lib.llama_get_memory(ctx)
        batch = _Batch(lib, self.n_batch)
        waiting = deque(sorted(seqs, key=lambda s: s.arrival_s))
        running: list[_Seq] = []
        free_ids = list(range(n_parallel - 1, -1, -1))
        calls = 0
        start = time.perf_counter()
        try:
            while waiting or running:
                now = time.perf_counter() - start
                while waiting and free_ids and (not realtime or waiting[0].arrival_s <= now):
                    s = waiting.popleft()
                    s.seq_id = free_ids.pop()
                    running.append(s)
                if not running:
                    time.sleep(max(0.0, waiting[0].arrival_s - now))
                    continue
                batch.n = 0
                owners: list[_Seq] = []  # whose logits row each output is
                for s in running:  # decodes first: one token per generating sequence
                    if s.out:
                        batch.add([s.out[-1]], len(s.prompt) + len(s.out) - 1, s.seq_id, True)
                        owners.append(s)
                for s in running:  # then prompt chunks within the step's token budget
                    left = len(s.prompt) - s.n_prefilled
                    room = self.n_batch - batch.n
                    if left == 0 or room == 0:
                        continue
                    k = min(left, room)
                    done = k == left
                    batch.add(s.prompt[s.n_prefilled : s.n_prefilled + k], s.n_prefilled, s.seq_id, done)
                    s.n_prefilled += k
                    if done:
                        owners.append(s)
                batch.struct.n_tokens = batch.n
                rc = lib.llama_decode(ctx, batch.struct)
                calls += 1
                if rc != 0:
                    raise RuntimeError(f"llama_decode returned {rc}")
                if owners:
                    ptr = lib.llama_get_logits(ctx)
                    rows = np.ctypeslib.as_array(ptr, shape=(len(owners), self.n_vocab))
                    next_ids = rows.argmax(axis=1).tolist()
                    now = time.perf_counter() - start
                    for s, tok in zip(owners, next_ids, strict=True):
                        if not s.out:
                            s.first_s = now
                        s.out.append(int(tok))
                finished = [s for s in running if len(s.out) >= s.max_new]
                for s in finished:
                    s.finish_s = time.perf_counter() - start
                    lib.llama_memory_seq_rm(mem, s.seq_id, -1, -1)
                    free_ids.append(s.seq_id)
                    running.remove(s)
            return time.perf_counter() - start, calls
        finally:
            lib.llama_free(ctx)

    def run_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int | None = None
    ) -> BatchResult:
        n_par = batch_size or len(prompts)
        seqs = [_Seq(i, list(p), max_new_tokens, 0.0) for i, p in enumerate(prompts)]
        seconds, calls = self._drive(seqs, n_par, realtime=False)
        outs = [s.out for s in seqs]
        return BatchResult(
            self.name, self.dtype or "?", f"continuous {n_par}", len(prompts), sum(map(len, prompts)),
            sum(map(len, outs)), seconds, calls, calls, max_new_tokens, outs,
        )

    def run_one_by_one(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> BatchResult:
        results = [self.run_batch([p], max_new_tokens) for p in prompts]
        outs = [r.token_ids[0] for r in results if r.token_ids]
        return BatchResult(
            self.name, self.dtype or "?", "one-by-one", len(prompts), sum(map(len, prompts)),
            sum(map(len, outs)), sum(r.seconds for r in results), len(prompts), sum(r.steps for r in results),
            max_new_tokens, outs,
        )

    def run_stream(self, prompt: Sequence[int], max_new_tokens: int) -> StreamResult:
        s = _Seq(0, list(prompt), max_new_tokens, 0.0)
        seconds, _ = self._drive([s], 1, realtime=False)
        n = len(s.out)
        tpot = (s.finish_s - s.first_s) / (n - 1) if n > 1 else float("nan")
        return StreamResult(self.name, self.dtype or "?", len(prompt), n, s.first_s, tpot, seconds, s.out)

    def run_serving(
        self, requests: Sequence[Any], rate: float = float("nan"), n_parallel: int = 64
    ) -> ServingResult:
        """Continuous batching with up to ``n_parallel`` sequences, requests admitted as they arrive."""
        seqs = [_Seq(i, list(r.prompt.token_ids), r.max_new_tokens, r.arrival_s) for i, r in enumerate(requests)]
        self._drive(seqs, n_parallel, realtime=True)
        res = ServingResult(self.name, self.dtype or "?", f"continuous {n_parallel}", rate)
        res.requests = [RequestTiming(s.arrival_s, s.first_s, s.finish_s, len(s.prompt), len(s.out)) for s in seqs]
        return res

    def batched_bench(self, npp: int, ntg: int, npl: Sequence[int]) -> list[dict[str, float]]:
        """llama.cpp's own C driver on the same GGUF, as a cross-check that the Python step loop above
        costs nothing measurable."""
        if self.gguf is None:
            return []
        return batched_bench(self.gguf, self.n_batch, self.n_ubatch, self.kv_unified, npp, ntg, npl)

    def close(self) -> None:
        if self.model is not None and self.lib is not None:
            self.lib.llama_model_free(self.model)
        self.model = None
