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
same prompt token ids for all; 2 threads; tokens actually generated are counted and reported.

minigpt's own adapter is not here: ``scripts/bench.py`` subclasses ``Peer`` for it (it may
override ``run_serving`` with its continuous-batching front) and adds it to the list that
``all_peers()`` returns.

Where peers come from (each is optional; a missing one is skipped with a one-line reason):
  - transformers: ``pip install transformers``.
  - CTranslate2: ``pip install ctranslate2``; the model is converted in-process with
    ``ctranslate2.converters.TransformersConverter``.
  - llama.cpp: python bindings ``llama_cpp`` (``pip install llama-cpp-python``), or the bindings'
    source beside a llama.cpp built with ``-DBUILD_SHARED_LIBS=ON`` (``MINIGPT_LLAMA_CPP_DIR`` = the
    llama.cpp source dir with ``build/bin/libllama.so``; the bindings are looked for in
    ``MINIGPT_LLAMA_CPP_PYTHON`` or two levels up, as in llama-cpp-python's sdist
    ``vendor/llama.cpp``). GGUF files are made with that dir's ``convert_hf_to_gguf.py``.
Conversions are cached under ``$MINIGPT_PEERS_DIR/cache`` (default /work/peers if it exists, else
~/.cache/minigpt/peers), keyed by the checkpoint's path and its files' sizes and mtimes.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

THREADS = int(os.environ.get("MINIGPT_BENCH_THREADS", os.cpu_count() or 1))


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------


@dataclass
class BatchResult:
    """Many prompts generated to completion: throughput and the average time per decode step."""

    engine: str
    dtype: str
    mode: str  # "one-by-one", "static batch 32", "continuous 32", ...
    n_prompts: int
    prompt_tokens: int
    tokens_generated: int
    seconds: float
    calls: int  # generate calls (static/one-by-one) or model steps (continuous batching)
    steps: int  # model forward passes: calls x max_new_tokens for generate calls, decode calls otherwise
    max_new_tokens: int
    token_ids: list[list[int]] | None = None  # generated ids per prompt, for fidelity checks

    @property
    def tok_per_s(self) -> float:
        return self.tokens_generated / self.seconds if self.seconds > 0 else float("nan")

    @property
    def ms_per_step(self) -> float:
        """Wall time per model step: the per-token latency each sequence of the batch sees (seed 002)."""
        return 1000.0 * self.seconds / self.steps if self.steps else float("nan")


@dataclass
class StreamResult:
    """One request timed token by token."""

    engine: str
    dtype: str
    prompt_tokens: int
    tokens_generated: int
    ttft_s: float  # request start -> first generated token available
    tpot_s: float  # mean time between the following tokens
    seconds: float  # request start -> last token
    token_ids: list[int] | None = None

    @property
    def tok_per_s(self) -> float:
        return self.tokens_generated / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class RequestTiming:
    """One request of a serving run; times in seconds from the run's start."""

    arrival_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    tokens_generated: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        n = self.tokens_generated - 1
        return (self.finish_s - self.first_token_s) / n if n > 0 else float("nan")


@dataclass
class ServingResult:
    """A Poisson-arrival run: per-request TTFT/TPOT and overall throughput."""

    engine: str
    dtype: str
    mode: str
    rate: float
    requests: list[RequestTiming] = field(default_factory=list)

    @property
    def tokens_generated(self) -> int:
        return sum(r.tokens_generated for r in self.requests)

    @property
    def seconds(self) -> float:
        return max(r.finish_s for r in self.requests) if self.requests else float("nan")

    @property
    def tok_per_s(self) -> float:
        return self.tokens_generated / self.seconds

    def summary(self) -> dict[str, float]:
        """TTFT/TPOT p50/p99 in ms and throughput."""
        from workloads import percentile  # scripts/ is on sys.path when bench.py runs

        ttft = [1000 * r.ttft_s for r in self.requests]
        tpot = [1000 * r.tpot_s for r in self.requests if r.tokens_generated > 1]
        return {
            "rate": self.rate,
            "requests": len(self.requests),
            "tok_per_s": self.tok_per_s,
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50),
            "tpot_p99_ms": percentile(tpot, 99),
        }


def median_batch(results: Sequence[BatchResult]) -> BatchResult:
    """The repetition with the median wall time (token counts are equal across repetitions)."""
    ordered = sorted(results, key=lambda r: r.seconds)
    return ordered[(len(ordered) - 1) // 2]


def median_stream(results: Sequence[StreamResult]) -> StreamResult:
    """Median TTFT, TPOT and total time, each over the repetitions."""
    return replace(
        results[0],
        ttft_s=statistics.median(r.ttft_s for r in results),
        tpot_s=statistics.median(r.tpot_s for r in results),
        seconds=statistics.median(r.seconds for r in results),
    )


def repeat(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> list[Any]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times; return those results."""
    for _ in range(warmup):
        fn()
    return [fn() for _ in range(repeats)]


# ----------------------------------------------------------------------------------------------
# The adapter interface
# ----------------------------------------------------------------------------------------------


class Peer(ABC):
    """One engine. Subclasses fill in availability, preparation, batch and stream runs."""

    name: str = "peer"
    dtypes: tuple[str, ...] = ("float32",)  # what a run without --dtypes measures
    extra_dtypes: tuple[str, ...] = ()  # also accepted, measured only when named

    def __init__(self) -> None:
        self.dtype: str | None = None
        self.checkpoint_dir: Path | None = None

    @abstractmethod
    def unavailable_reason(self) -> str | None:
        """None when the engine can run here, else one line saying what is missing and how to get it."""

    def available(self) -> bool:
        return self.unavailable_reason() is None

    @abstractmethod
    def prepare(self, checkpoint_dir: str | Path, dtype: str) -> None:
        """Convert the HF checkpoint if needed (cached) and load it in ``dtype``."""

    @abstractmethod
    def run_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int | None = None
    ) -> BatchResult:
        """Generate for all prompts, ``batch_size`` at a time (None: all at once)."""

    def run_one_by_one(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> BatchResult:
        """The loop a user writes without batching: one request after the other."""
        r = self.run_batch(prompts, max_new_tokens, batch_size=1)
        r.mode = "one-by-one"
        return r

    @abstractmethod
    def run_stream(self, prompt: Sequence[int], max_new_tokens: int) -> StreamResult:
        """One request alone, timing its first token and the tokens after it."""

    def run_serving(self, requests: Sequence[Any], rate: float = float("nan")) -> ServingResult:
        """Serve ``workloads.ServingRequest``s as they arrive, first come first served, one at a time.

        This is what an engine without a server loop offers; llama.cpp overrides it with
        continuous batching.
        """
        result = ServingResult(self.name, self.dtype or "?", "one-at-a-time FCFS", rate)
        start = time.perf_counter()
        for req in sorted(requests, key=lambda r: r.arrival_s):
            now = time.perf_counter() - start
            if now < req.arrival_s:
                time.sleep(req.arrival_s - now)
            begin = time.perf_counter() - start
            s = self.run_stream(req.prompt.token_ids, req.max_new_tokens)
            result.requests.append(
                RequestTiming(req.arrival_s, begin + s.ttft_s, begin + s.seconds, s.prompt_tokens,
                              s.tokens_generated)
            )
        return result

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for peers that hold nothing
        """Free the loaded model."""

    def label(self) -> str:
        return f"{self.name} {self.dtype}"


# ----------------------------------------------------------------------------------------------
# Shared helpers: cache dirs, checkpoint keys
# ----------------------------------------------------------------------------------------------


def peers_dir() -> Path:
    """Where peers are built and conversions cached."""
    env = os.environ.get("MINIGPT_PEERS_DIR")
    if env:
        return Path(env)
    if Path("/work/peers").is_dir():
        return Path("/work/peers")
    return Path.home() / ".cache" / "minigpt" / "peers"


def checkpoint_cache_dir(checkpoint_dir: str | Path) -> Path:
    """A cache folder unique to this checkpoint's path and its files' sizes and mtimes."""
    ckpt = Path(checkpoint_dir).resolve()
    h = hashlib.sha256(str(ckpt).encode())
    for f in sorted(ckpt.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    d = peers_dir() / "cache" / f"{ckpt.name}-{h.hexdigest()[:12]}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _eos_id(checkpoint_dir: Path) -> int:
    cfg = json.loads((checkpoint_dir / "config.json").read_text())
    return int(cfg.get("eos_token_id", 50256))


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# ----------------------------------------------------------------------------------------------
# HF transformers
# ----------------------------------------------------------------------------------------------


class HFPeer(Peer):
    """``GPT2LMHeadModel.generate``: one by one, or a static batch padded on the left."""

    name = "transformers"
    dtypes = ("float32", "bfloat16")

    def __init__(self) -> None:
        super().__init__()
        self.model: Any = None
        self.eos = 50256

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("transformers") is None:
            return "transformers not installed (pip install transformers)"
        return None

    def prepare(self, checkpoint_dir: str | Path, dtype: str) -> None:
        import torch
        from transformers import GPT2LMHeadModel

        torch.set_num_threads(THREADS)
        self.checkpoint_dir = Path(checkpoint_dir)
        self.eos = _eos_id(self.checkpoint_dir)
        self.dtype = dtype
        self.model = GPT2LMHeadModel.from_pretrained(
            self.checkpoint_dir, dtype=getattr(torch, dtype)
        ).eval()
        # Never stop at EOS: every engine generates exactly max_new_tokens.
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = self.eos

    def _gen_kwargs(self, max_new_tokens: int) -> dict[str, Any]:
        return dict(
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=self.eos,
        )

    def run_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int | None = None
    ) -> BatchResult:
        import torch

        bs = batch_size or len(prompts)
        outs: list[list[int]] = []
        calls = 0
        start = time.perf_counter()
        with torch.inference_mode():
            for chunk in _chunks(prompts, bs):
                width = max(len(p) for p in chunk)
                ids = torch.full((len(chunk), width), self.eos, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for i, p in enumerate(chunk):  # left padding: the new tokens line up on the right
                    ids[i, width - len(p) :] = torch.tensor(p)
                    mask[i, width - len(p) :] = 1
                out = self.model.generate(input_ids=ids, attention_mask=mask, **self._gen_kwargs(max_new_tokens))
                outs.extend(out[:, width:].tolist())
                calls += 1
        seconds = time.perf_counter() - start
        return BatchResult(
            self.name, self.dtype or "?", f"static batch {bs}", len(prompts), sum(map(len, prompts)),
            sum(map(len, outs)), seconds, calls, calls * max_new_tokens, max_new_tokens, outs,
        )

    def run_stream(self, prompt: Sequence[int], max_new_tokens: int) -> StreamResult:
        import torch
        from transformers.generation.streamers import BaseStreamer

        class _Clock(BaseStreamer):
            """Records when generate hands out each new token (its first put() is the prompt)."""

            def __init__(self) -> None:
                self.times: list[float] = []
                self.seen_prompt = False

            def put(self, value: Any) -> None:
                if not self.seen_prompt:
                    self.seen_prompt = True
                    return
                self.times.append(time.perf_counter())

            def end(self) -> None:
                pass

        clock = _Clock()
        ids = torch.tensor([list(prompt)])
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), streamer=clock,
                **self._gen_kwargs(max_new_tokens),
            )
        end = time.perf_counter()
        gen = out[0, len(prompt) :].tolist()
        t = clock.times
        tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else float("nan")
        return StreamResult(self.name, self.dtype or "?", len(prompt), len(gen), t[0] - start, tpot,
                            end - start, gen)

    def close(self) -> None:
        self.model = None


# ----------------------------------------------------------------------------------------------
# CTranslate2
# ----------------------------------------------------------------------------------------------


class CTranslate2Peer(Peer):
    """``ctranslate2.Generator.generate_batch`` (static batches) and ``generate_tokens`` (stream)."""

    name = "ctranslate2"
    dtypes = ("float32", "int8")
    _QUANT = {"float32": "float32", "int8": "int8", "int8_float32": "int8", "bfloat16": "bfloat16"}

    def __init__(self) -> None:
        super().__init__()
        self.generator: Any = None
        self.vocab: list[str] = []

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("ctranslate2") is None:
            return "ctranslate2 not installed (pip install ctranslate2)"
        if importlib.util.find_spec("transformers") is None:
            return "ctranslate2's converter needs transformers (pip install transformers)"
        return None

    def convert(self, checkpoint_dir: str | Path, quantization: str) -> Path:
        """The CTranslate2 model dir for this checkpoint and quantization, converting once."""
        out = checkpoint_cache_dir(checkpoint_dir) / f"ct2-{quantization}"
        if not (out / "model.bin").exists():
            from ctranslate2.converters import TransformersConverter

            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            TransformersConverter(str(checkpoint_dir)).convert(str(tmp), quantization=quantization, force=True)
            tmp.rename(out)
        return out

    def prepare(self, checkpoint_dir: str | Path, dtype: str) -> None:
        import ctranslate2

        self.checkpoint_dir = Path(checkpoint_dir)
        self.dtype = dtype
        model_dir = self.convert(checkpoint_dir, self._QUANT[dtype])
        self.vocab = json.loads((model_dir / "vocabulary.json").read_text(encoding="utf-8"))
        self.generator = ctranslate2.Generator(
            str(model_dir), device="cpu", compute_type=dtype, inter_threads=1, intra_threads=THREADS
        )

    def _tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.vocab[i] for i in ids]

    def run_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int | None = None
    ) -> BatchResult:
        bs = batch_size or len(prompts)
        outs: list[list[int]] = []
        calls = 0
        start = time.perf_counter()
        for chunk in _chunks(prompts, bs):
            res = self.generator.generate_batch(
                [self._tokens(p) for p in chunk],
                max_batch_size=bs,
                beam_size=1,
                sampling_topk=1,
                max_length=max_new_tokens,
                min_length=max_new_tokens,
                end_token=[],  # no end token: generate exactly max_new_tokens
                include_prompt_in_result=False,
            )
            outs.extend(r.sequences_ids[0] for r in res)
            calls += 1
        seconds = time.perf_counter() - start
        return BatchResult(
            self.name, self.dtype or "?", f"static batch {bs}", len(prompts), sum(map(len, prompts)),
            sum(map(len, outs)), seconds, calls, calls * max_new_tokens, max_new_tokens, outs,
        )

    def run_stream(self, prompt: Sequence[int], max_new_tokens: int) -> StreamResult:
        times: list[float] = []
        gen: list[int] = []
        start = time.perf_counter()
        for step in self.generator.generate_tokens(
            self._tokens(prompt), max_length=max_new_tokens, min_length=max_new_tokens,
            sampling_topk=1, end_token=[],
        ):
            times.append(time.perf_counter())
            gen.append(step.token_id)
        end = time.perf_counter()
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
        return StreamResult(self.name, self.dtype or "?", len(prompt), len(gen), times[0] - start, tpot,
                            end - start, gen)

    def close(self) -> None:
        self.generator = None


# ----------------------------------------------------------------------------------------------
# llama.cpp
# ----------------------------------------------------------------------------------------------


def llama_cpp_dir() -> Path | None:
    """The llama.cpp source/build dir: $MINIGPT_LLAMA_CPP_DIR, else one found under peers_dir()."""
    env = os.environ.get("MINIGPT_LLAMA_CPP_DIR")
    if env:
        return Path(env)
    candidates = sorted(glob.glob(str(peers_dir() / "llama_cpp_python-*" / "vendor" / "llama.cpp")))
    candidates += [str(peers_dir() / "llama.cpp")]
    for c in reversed(candidates):
        if (Path(c) / "convert_hf_to_gguf.py").exists():
            return Path(c)
    return None


def llama_cpp_binary(name: str) -> str | None:
    """A llama.cpp tool (e.g. ``llama-batched-bench``) from the build dir or PATH."""
    d = llama_cpp_dir()
    if d is not None and (d / "build" / "bin" / name).exists():
        return str(d / "build" / "bin" / name)
    return shutil.which(name)


def _import_llama_cpp() -> Any:
    """``llama_cpp`` bindings: installed, or the sdist's python beside a shared-lib llama.cpp build."""
    try:
        return _quiet_llama(importlib.import_module("llama_cpp"))
    except ImportError:
        pass
    d = llama_cpp_dir()
    lib_dir = d / "build" / "bin" if d is not None else None
    py_dir = os.environ.get("MINIGPT_LLAMA_CPP_PYTHON") or (str(d.parent.parent) if d is not None else None)
    if lib_dir is None or not (lib_dir / "libllama.so").exists():
        raise ImportError("no llama_cpp module and no llama.cpp build with libllama.so (see MINIGPT_LLAMA_CPP_DIR)")
    if py_dir is None or not (Path(py_dir) / "llama_cpp" / "llama_cpp.py").exists():
        raise ImportError("llama_cpp python bindings not found (set MINIGPT_LLAMA_CPP_PYTHON)")
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(lib_dir))
    sys.path.insert(0, py_dir)
    return _quiet_llama(importlib.import_module("llama_cpp"))


def _quiet_llama(module: Any) -> Any:
    """The bindings print every llama.cpp log line (hundreds per context) unless their logger says not to."""
    import logging

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return module


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
    chunks of newly admitted ones (as llama-server schedules its slots); sequences share a unified
    KV cache and leave it as soon as they have their tokens. Greedy = argmax of the logits rows.
    """

    name = "llama.cpp"
    dtypes = ("float32", "bfloat16", "q8_0")
    _OUTTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "q8_0": "q8_0"}

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
            _import_llama_cpp()
        except Exception as e:  # a missing or mismatched shared library raises OSError, not ImportError
            return f"llama.cpp bindings unavailable ({e})"
        return None

    def convert(self, checkpoint_dir: str | Path, dtype: str) -> Path:
        """The GGUF file for this checkpoint and type, made once with convert_hf_to_gguf.py."""
        out = checkpoint_cache_dir(checkpoint_dir) / f"model-{self._OUTTYPE[dtype]}.gguf"
        if out.exists():
            return out
        d = llama_cpp_dir()
        if d is None or not (d / "convert_hf_to_gguf.py").exists():
            raise RuntimeError("convert_hf_to_gguf.py not found (set MINIGPT_LLAMA_CPP_DIR to a llama.cpp source dir)")
        ckpt = Path(checkpoint_dir)
        cfg = json.loads((ckpt / "config.json").read_text())
        src = ckpt
        if "n_ctx" not in cfg:  # the converter reads GPT-2's context size from n_ctx
            src = checkpoint_cache_dir(checkpoint_dir) / "hf-with-n_ctx"
            src.mkdir(exist_ok=True)
            for f in ckpt.iterdir():
                if f.is_file() and not (src / f.name).exists():
                    os.symlink(f.resolve(), src / f.name)
            (src / "config.json").unlink()
            cfg["n_ctx"] = cfg.get("n_positions", 1024)
            (src / "config.json").write_text(json.dumps(cfg, indent=2))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(d / "gguf-py"), env.get("PYTHONPATH")]))
        tmp = out.with_suffix(".tmp")
        cmd = [sys.executable, str(d / "convert_hf_to_gguf.py"), str(src), "--outtype", self._OUTTYPE[dtype],
               "--outfile", str(tmp)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed: {proc.stderr.strip().splitlines()[-1:]}")
        tmp.rename(out)
        return out

    def prepare(self, checkpoint_dir: str | Path, dtype: str) -> None:
        self.close()
        self.lib = _import_llama_cpp()
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
        """llama.cpp's own C driver (``llama-batched-bench``) on the same GGUF, as a cross-check
        that the Python step loop above costs nothing measurable. Rows: PP, TG, B, T_PP s, S_TG t/s..."""
        exe = llama_cpp_binary("llama-batched-bench")
        if exe is None or self.gguf is None:
            return []
        n_ctx = -(-max(npl) * (npp + ntg) // 256) * 256
        cmd = [exe, "-m", str(self.gguf), "-c", str(n_ctx), "-b", str(self.n_batch), "-ub", str(self.n_ubatch),
               "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(map(str, npl)), "-t", str(THREADS),
               "-tb", str(THREADS)] + (["--kv-unified"] if self.kv_unified else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        rows = []
        cols = ["PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s"]
        for line in (proc.stdout + proc.stderr).splitlines():
            m = re.match(r"^\|\s*\d", line)
            if m:
                vals = [float(v) for v in line.strip().strip("|").split("|")]
                rows.append(dict(zip(cols, vals, strict=True)))
        return rows

    def close(self) -> None:
        if self.model is not None and self.lib is not None:
            self.lib.llama_model_free(self.model)
        self.model = None


# ----------------------------------------------------------------------------------------------
# Registry and machine limits
# ----------------------------------------------------------------------------------------------


def all_peers() -> list[Peer]:
    """Every peer adapter (minigpt's is added by scripts/bench.py)."""
    return [HFPeer(), CTranslate2Peer(), LlamaCppPeer()]


def memory_bandwidth_gbs(n_bytes: int = 1 << 30, repeats: int = 7) -> dict[str, float]:
    """Measured memory bandwidth in GB/s: a large fp32 sum (read only) and copy (read + write)."""
    import torch

    torch.set_num_threads(THREADS)
    x = torch.ones(n_bytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    y.copy_(x)  # touch every page first

    def best(fn: Callable[[], Any], moved: int) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return moved / statistics.median(times) / 1e9

    return {
        "read_sum_gbs": best(lambda: x.sum(), n_bytes),
        "copy_gbs": best(lambda: y.copy_(x), 2 * n_bytes),
    }


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]  # idle + iowait
    return sum(vals) - idle, sum(vals)


def cpu_busy(interval: float = 1.0) -> float:
    """Fraction of all cores busy over ``interval`` seconds (Linux /proc/stat; nan elsewhere).

    Timings on a 2-core machine are meaningless while something else runs: the bench checks this
    before each measurement and says so."""
    try:
        b0, t0 = _cpu_times()
        time.sleep(interval)
        b1, t1 = _cpu_times()
    except OSError:
        return float("nan")
    return (b1 - b0) / max(1, t1 - t0)


class OtherLoad:
    """Context manager: the share of the machine's cores that *other* processes used meanwhile.

    Total busy time (from /proc/stat) minus this process's own CPU time (all its threads and
    waited-for children), over cores x wall time. Above ~0.1 a timing on 2 cores is suspect.
    """

    share: float = float("nan")

    def __enter__(self) -> OtherLoad:
        self._own0 = sum(os.times()[:4])
        self._wall0 = time.perf_counter()
        try:
            self._busy0 = _cpu_times()[0]
        except OSError:
            self._busy0 = -1
        return self

    def __exit__(self, *exc: object) -> None:
        if self._busy0 < 0:
            return
        wall = time.perf_counter() - self._wall0
        busy = (_cpu_times()[0] - self._busy0) / os.sysconf("SC_CLK_TCK")
        own = sum(os.times()[:4]) - self._own0
        self.share = max(0.0, busy - own) / ((os.cpu_count() or 1) * max(wall, 1e-9))


def wait_until_quiet(max_busy: float = 0.15, timeout_s: float = 300.0, log: Callable[[str], None] = print) -> float:
    """Block until the machine is (nearly) idle or ``timeout_s`` passes; returns the last busy fraction."""
    deadline = time.monotonic() + timeout_s
    busy = cpu_busy()
    while busy > max_busy and time.monotonic() < deadline:
        log(f"machine {busy:.0%} busy with other work; waiting for it to settle")
        busy = cpu_busy(5.0)
    return busy


def gpt2_decode_bytes(checkpoint_dir: str | Path, bytes_per_param: float) -> float:
    """Bytes of weights one batch-1 decode step must read: every matrix once, the tied embedding
    as the LM head, one row of the position table (so ``/ bandwidth`` is the step's lower bound)."""
    cfg = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    d, n_layer, vocab = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
    inner = cfg.get("n_inner") or 4 * d
    per_layer = d * 3 * d + 3 * d + d * d + d + d * inner + inner + inner * d + d + 4 * d
    params = n_layer * per_layer + vocab * d + 2 * d + d
    return params * bytes_per_param
