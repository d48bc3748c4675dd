"""A batch job's run: lines read on a thread as the window lets them in, all in flight answered at once, each
result written as it completes; at most `max_in_flight` lines ahead, so memory stays flat."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from minigpt.batch_jobs.answer import Answer, Answerer, custom_id_of, line_key
from minigpt.batch_jobs.files import ResultWriter
from minigpt.common.progress import Progress

END = None  # what the reader thread queues after the last line


class RepeatedCustomId(ValueError):
    """A custom_id seen before on stdin, which cannot be checked before the job starts."""


class EngineStopped(RuntimeError):
    """The engine can no longer answer (its thread failed): what is left is not written, a rerun does it."""


@dataclass
class Summary:

    requests: int = 0
    failed: int = 0
    skipped: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_time_s: float = 0.0
    stopped_by: str | None = None
    started: float = field(default_factory=time.perf_counter, repr=False)

    def add(self, answer: Answer) -> None:
        self.requests += 1
        self.failed += answer.failed
        self.prompt_tokens += answer.prompt_tokens
        self.completion_tokens += answer.completion_tokens

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def finish(self) -> None:
        self.wall_time_s = round(time.perf_counter() - self.started, 3)

    def as_json(self) -> dict:
        data = asdict(self)
        del data["started"]
        data["tokens_per_s"] = round(self.tokens / self.wall_time_s, 1) if self.wall_time_s else None
        return data

    def line(self, output: str) -> str:
        skipped = f", {self.skipped} skipped as already in {output}" if self.skipped else ""
        rate = f" ({self.tokens / self.wall_time_s:,.0f} tok/s)" if self.wall_time_s else ""
        return (f"{self.requests} requests ({self.failed} failed{skipped}), {self.prompt_tokens:,} prompt + "
                f"{self.completion_tokens:,} completion tokens in {self.wall_time_s:.1f} s{rate}")


async def run_job(answerer: Answerer, lines: Iterator[tuple[int, str | UnicodeDecodeError]], done: set[int],
                  writer: ResultWriter, progress: Progress, summary: Summary, max_in_flight: int,
                  source: str, check_repeats: bool) -> None:
    """Answers every line whose key is not in `done`; cancelled, its requests in flight are not written."""
    reader = _Reader(lines, asyncio.get_running_loop(), min(max_in_flight, 256))
    slots = asyncio.Semaphore(max_in_flight)  # lines read ahead of their results
    seen: set[int] = set()
    tasks: set[asyncio.Task] = set()
    job, ended = asyncio.current_task(), []  # ended: what stops the job from inside a line's task

    async def complete(number: int, text: str | UnicodeDecodeError) -> None:
        try:
            answer = await answerer.answer(number, text)
            if answer.record["response"]["status_code"] == 503:
                raise EngineStopped(answer.record["response"]["body"]["error"]["message"])
            writer.write(answer.record)
            summary.add(answer)
            progress.update(summary.requests, summary.tokens, summary.failed)
        except Exception as err:  # the engine stopped or the output cannot be written: the job ends
            if not ended:
                ended.append(err)
                job.cancel()
        finally:
            slots.release()

    try:
        while True:
            await slots.acquire()
            item = await reader.get()
            if isinstance(item, BaseException):
                raise item
            if item is END:
                break
            number, text = item
            key = line_key(custom_id_of(text), number)
            if key in done:
                summary.skipped += 1
                slots.release()
                continue
            if check_repeats:
                if key in seen:
                    raise RepeatedCustomId(f"line {number} of {source} repeats a custom_id given before "
                                           f"({custom_id_of(text)!r}): custom_ids must be unique")
                seen.add(key)
            task = asyncio.create_task(complete(number, text))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        if ended:
            raise ended[0] from None
        raise
    finally:
        reader.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Reader:
    """Lines read on a daemon thread, at most `ahead` of the job: a blocking stdin never holds the event loop."""

    def __init__(self, lines: Iterator, loop: asyncio.AbstractEventLoop, ahead: int) -> None:
        self._lines, self._loop = lines, loop
        self._queue: asyncio.Queue = asyncio.Queue()  # bounded by _room
        self._room = threading.Semaphore(ahead)
        self._stopped = False
        threading.Thread(target=self._run, name="minigpt-batch-reader", daemon=True).start()

    async def get(self) -> object:
        """The next (line number, text), END, or the exception that ended the reading."""
        item = await self._queue.get()
        self._room.release()
        return item

    def stop(self) -> None:
        self._stopped = True
        self._room.release()  # a reader waiting for room wakes and ends

    def _run(self) -> None:
        try:
            for item in self._lines:
                self._room.acquire()
                if self._stopped:
                    return
                self._put(item)
            self._put(END)
        except Exception as err:  # reading failed: the job reports it
            self._put(err)

    def _put(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop closed: the job ended first
            self._stopped = True
