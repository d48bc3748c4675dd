"""Tensor parallelism's processes: rank 0's runner (the caller's process) sends each step's inputs down one pipe
per worker rank it spawns, runs its own shard and returns the logits; the all-reduces go through the group. A
worker that dies breaks the group: the step in flight fails, and every later one."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from minigpt.engine.config import EngineConfig
from minigpt.engine.runner import ModelRunner, StepInputs
from minigpt.model.attention import StepMetadata
from minigpt.model.config import GPT2Config
from minigpt.model.gpt2 import GPT2
from minigpt.model.weights import resolve_device
from minigpt.tensor_parallel.group import all_reducer, close_group, join_store, open_group, open_store
from minigpt.tensor_parallel.shard import Shard, check_divisible

LOAD_TIMEOUT_S = 600
STOP_TIMEOUT_S = 10  # then a worker told to stop is killed
STOPPED_STATES = ("T", "t")  # stopped by a signal, or by a tracer
DEATH_GRACE_S = 1.0  # a killed rank's sockets close before its exit shows
Load = Callable[[Path, EngineConfig, Shard], GPT2]


@dataclass
class Worker:
    rank: int
    process: mp.Process
    conn: Connection


class Ranks:
    """The worker processes and the group; `stop()` (close, or the runner's finalizer) ends them all."""

    def __init__(self) -> None:
        self.workers: list[Worker] = []
        self.group = None

    def stop(self) -> None:
        for worker in self.workers:
            try:
                worker.conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
        close_group(self.group)
        self.workers, self.group = [], None


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: starts ranks 1..N-1, runs each step on every rank."""

    def __init__(self, path: Path, config: EngineConfig, load: Load) -> None:
        world = config.tensor_parallel_size
        check_divisible(GPT2Config.from_json_file(path / "config.json"), world)
        device = resolve_device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs (one per rank); "
                             f"this machine has {torch.cuda.device_count()}")
        self.ranks = Ranks()
        self._finalizer = weakref.finalize(self, self.ranks.stop)
        self._broken: str | None = None
        self._copies: list[tuple[int, int]] = []  # beam search's copy-on-write blocks, sent with the next step
        try:
            store = open_store(world)
            context = mp.get_context("spawn")
            for rank in range(1, world):
                conn, child_conn = context.Pipe()
                process = context.Process(
                    target=worker_main, args=(rank, world, store.port, path, config, load, child_conn),
                    name=f"minigpt-tp-rank{rank}", daemon=True,
                )
                process.start()
                child_conn.close()
                self.ranks.workers.append(Worker(rank, process, conn))
            self.shard = Shard(0, world)
            model = load(path, config, self.shard)
            super().__init__(model, config, self.shard.cache_config(model.config))
            for worker in self.ranks.workers:
                _wait_loaded(worker)
            self.ranks.group = open_group(store, 0, world, self.device)
            self.shard.all_reduce = all_reducer(self.ranks.group)
        except BaseException:
            self._finalizer()
            raise

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Every rank runs the step; rank 0's logits (the head is replicated) come back."""
        self._check_ranks()
        step, self._copies = (self._copies, model_inputs(inputs, pack)), []
        payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for worker in self.ranks.workers:
                worker.conn.send_bytes(payload)
            return super().run(inputs)
        except Exception as err:
            self._broken = f"a tensor-parallel step failed ({type(err).__name__}: {err})"
            for worker in self.ranks.workers:
                worker.process.join(DEATH_GRACE_S)
            self._check_ranks()
            raise RuntimeError(self._broken + "; close this LLM and start another") from err

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy rank 0's heads' blocks now, the workers' with the next step."""
        super().copy_blocks(copies)
        self._copies += copies

    def problem(self) -> str | None:
        """A rank that exited or is stopped (its next step would hang), or the step that broke the group."""
        for worker in self.ranks.workers:
            if not worker.process.is_alive():
                return f"tensor-parallel rank {worker.rank} exited (exit code {worker.process.exitcode})"
            if _process_state(worker.process.pid) in STOPPED_STATES:
                return f"tensor-parallel rank {worker.rank} is stopped (pid {worker.process.pid})"
        return self._broken

    def _check_ranks(self) -> None:
        for worker in self.ranks.workers:
            if not worker.process.is_alive():
                self._broken = (f"tensor-parallel rank {worker.rank} exited (exit code {worker.process.exitcode}); "
                                "close this LLM and start another")
        if self._broken is not None:
            raise RuntimeError(self._broken)

    def close(self) -> None:
        super().close()
        self._finalizer()


def model_inputs(inputs: StepInputs, convert: Callable) -> StepInputs:
    """What the model reads of a step, each tensor through `convert`."""
    meta = inputs.meta
    segments = [replace(seg, block_table=None if seg.block_table is None else convert(seg.block_table))
                for seg in meta.prefills]
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    meta = StepMetadata(
        convert(meta.slot_mapping), segments, meta.num_prefill_tokens,
        None if tables is None else convert(tables), None if lens is None else convert(lens), meta.num_fresh,
    )
    return StepInputs(convert(inputs.input_ids), convert(inputs.positions), meta, convert(inputs.logits_indices),
                      [], [], [], [])


def pack(tensor: torch.Tensor) -> tuple[torch.dtype, list]:
    """A tensor as what pickles fastest: lists (a tensor pickles through torch.save)."""
    return tensor.dtype, tensor.tolist()


def unpacker(device: torch.device) -> Callable[[tuple[torch.dtype, list]], torch.Tensor]:
    return lambda packed: torch.tensor(packed[1], dtype=packed[0], device=device)


def _process_state(pid: int) -> str | None:
    """The state letter /proc shows for `pid`; None without /proc or such a process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _wait_loaded(worker: Worker) -> None:
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while not worker.conn.poll(0.2):
        if not worker.process.is_alive():
            raise RuntimeError(f"tensor-parallel rank {worker.rank} exited while starting "
                               f"(exit code {worker.process.exitcode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel rank {worker.rank} did not load its shard in {LOAD_TIMEOUT_S} s")
    error = worker.conn.recv()
    if error is not None:
        raise RuntimeError(f"tensor-parallel rank {worker.rank} could not start: {error}")


def worker_main(rank: int, world: int, port: int, path: Path, config: EngineConfig, load: Load,
                conn: Connection) -> None:
    """Rank `rank`: load the shard, join the group, run steps until an empty message or rank 0's pipe closes."""
    try:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if resolve_device(config.device).type == "cuda":
            torch.cuda.set_device(rank)
        shard = Shard(rank, world)
        model = load(path, config, shard)
        runner = ModelRunner(model, config, shard.cache_config(model.config))
        store = join_store(port, world)
    except Exception as err:
        conn.send(f"{type(err).__name__}: {err}")
        return
    conn.send(None)
    group = open_group(store, rank, world, runner.device)
    unpack = unpacker(runner.device)
    shard.all_reduce = all_reducer(group)
    with torch.inference_mode():
        while True:
            try:
                payload = conn.recv_bytes()
            except EOFError:
                break
            if not payload:
                break
            copies, inputs = pickle.loads(payload)
            runner.copy_blocks(copies)
            runner.run(model_inputs(inputs, unpack))
    runner.close()
    close_group(group)
