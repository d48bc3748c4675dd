"""A batch job's lines answered by N Ray actors, each a whole engine behind the job's own `Answerer`; the driver
keeps the files, window and progress. Ray restarts a replica that dies and sends its lines again: each line is
written once, by the driver, when its answer arrives."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from minigpt.async_llm.async_engine import AsyncLLM
from minigpt.batch_jobs.answer import Answer, Answerer
from minigpt.batch_jobs.job import EngineStopped
from minigpt.batch_jobs.window import Window
from minigpt.common.errors import USER_ERRORS, error_line
from minigpt.model.weights import resolve_checkpoint
from minigpt.replicas.cluster import ray_cluster
from minigpt.replicas.options import replica_resources
from minigpt.server.chat_template import ChatTemplate

START_NOTICE_S = 60
RESTARTS = 8  # per replica: past it (a line that kills every engine it meets), the job stops; a rerun resumes
ACTOR_NAME = "minigpt-batch-replica-{}"

logger = logging.getLogger("minigpt")


class BatchReplica:
    """One engine answering input lines, as a Ray actor. A checkpoint or flag it cannot load is kept as the
    line `ready` returns, so the driver reports it as the one-process job does."""

    def __init__(self, model: str, engine_args: dict, model_name: str, chat_template: Path | None,
                 max_in_flight: int) -> None:
        self.problem: Exception | None = None
        try:
            template = ChatTemplate.for_checkpoint(resolve_checkpoint(model), chat_template)
            self.llm = AsyncLLM(model, **engine_args)
        except USER_ERRORS as err:
            self.problem = err  # the front names its fields by their flags
            return
        self.answerer = Answerer(self.llm, model_name, template, Window(max_in_flight))

    def ready(self) -> Exception | None:
        return self.problem

    def pid(self) -> int:
        return os.getpid()

    async def answer(self, number: int, text: str | UnicodeDecodeError) -> Answer:
        return await self.answerer.answer(number, text)


class ReplicaAnswerer:
    """`Answerer.answer` over replica actors: a line goes to the one with the fewest lines in flight."""

    def __init__(self, actors: list, actor_error: type[Exception]) -> None:
        self.actors = actors
        self.in_flight = [0] * len(actors)
        self._actor_error = actor_error

    async def answer(self, number: int, text: str | UnicodeDecodeError) -> Answer:
        index = min(range(len(self.actors)), key=self.in_flight.__getitem__)
        self.in_flight[index] += 1
        try:
            return await self.actors[index].answer.remote(number, text)
        except self._actor_error as err:
            raise EngineStopped(f"replica {index} died more than {RESTARTS} times ({error_line(err)})") from None
        finally:
            self.in_flight[index] -= 1


@contextmanager
def replica_answerer(args: argparse.Namespace, engine_args: dict, model_name: str) -> Iterator[ReplicaAnswerer]:
    """args.replicas engine actors, ready, for the block; ValueError: one cannot load, or they do not fit."""
    resources = replica_resources(args)
    with ray_cluster(args.ray_address, args.quiet) as ray:
        if args.ray_address is None:
            _check_fits(ray.cluster_resources(), resources, args.replicas)
        actor = ray.remote(BatchReplica)
        options = dict(**resources, max_restarts=RESTARTS, max_task_retries=RESTARTS,
                       max_concurrency=args.max_in_flight + 4)  # + ready and pid beside a full window
        actors = [actor.options(name=ACTOR_NAME.format(i), **options).remote(
            args.model, engine_args, model_name, args.chat_template, args.max_in_flight)
            for i in range(args.replicas)]
        try:
            readiness = [a.ready.remote() for a in actors]
            while (waiting := ray.wait(readiness, num_returns=len(readiness), timeout=START_NOTICE_S)[1]):
                logger.warning("%d of %d replicas not started yet: each needs %s, the cluster has %s free",
                               len(waiting), len(actors), resources, ray.available_resources())
            problem = next((p for p in ray.get(readiness) if p is not None), None)
            if problem is not None:
                raise problem
            yield ReplicaAnswerer(actors, ray.exceptions.RayActorError)
        finally:
            for a in actors:
                ray.kill(a, no_restart=True)


def _check_fits(cluster: dict[str, float], each: dict[str, float], replicas: int) -> None:
    for name, key, flag in (("num_cpus", "CPU", "--cpus-per-replica"), ("num_gpus", "GPU", "--gpus-per-replica")):
        have = cluster.get(key, 0.0)
        if each[name] * replicas > have:
            raise ValueError(f"{replicas} replicas of {flag} {each[name]:g} need {each[name] * replicas:g} {key}s, "
                             f"this machine's Ray has {have:g}: give fewer, or a smaller {flag}")
