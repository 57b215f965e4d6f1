"""The lifecycle of the server's engines that take queued jobs on a device thread of their own
(`EmbeddingEngine`, `TranscriptionEngine`; the generation engine schedules its own turns).

Requests come from any thread (`submit`: a future); one thread runs the device (`run`): it compiles
(or loads) the engine's graphs (`warm_up`), sets `ready`, then serves the jobs queued (`serve`), a
turn at a time, until `stop()`; the jobs queued when it stops are served before `run` returns. A
failure of the device (or of the job as a whole) fails every job queued and ends the engine
(`failure`); the server's health route reads `ready` and `alive`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
from typing import Any

import torch
from transformers import PreTrainedModel

from ..errors import ServerBusyError

logger = logging.getLogger(__name__)

Job = tuple[Any, concurrent.futures.Future]


class QueuedEngine:
    """Queue, device thread and readiness of an engine (see the module's docstring).

    Subclasses set `name` (in messages), `jobs_per_turn` (None: every job queued), and define
    `warm_up` and `serve`.

    Args:
        model (`PreTrainedModel`): the model on the device.
    """

    name = "engine"
    jobs_per_turn: int | None = None
    batch_size = 1
    graphs_unloaded = 0  # (every graph is loaded before the engine serves)

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.ready, self.failure, self.alive, self.busy_slots = threading.Event(), None, False, 0
        self._queue: collections.deque[Job] = collections.deque()
        self._condition, self._stopping = threading.Condition(), False

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def device_memory(self) -> int:
        """The device memory allocated now, in bytes."""
        return getattr(torch, self.model.device.type).memory_allocated(self.model.device)

    def warm_up(self, show_progress: bool) -> None:
        """Compiles (or loads) every graph the engine serves with."""
        raise NotImplementedError

    def serve(self, jobs: list[Job]) -> None:
        """Serves `jobs` (each: its request, its future): sets each future; a failure of one job fails
        it alone, a failure of the device raises (and ends the engine)."""
        raise NotImplementedError

    def device_context(self) -> contextlib.AbstractContextManager:
        """What `warm_up` and `serve` run under (e.g. `torch.no_grad()`)."""
        return contextlib.nullcontext()

    def enqueue(self, request: Any) -> concurrent.futures.Future:
        """Queues `request`: a future of its result.

        Raises:
            ServerBusyError: the engine is not serving (starting, stopping or failed).
        """
        future = concurrent.futures.Future()
        with self._condition:
            if not self.ready.is_set() and not self._stopping and self.failure is None:
                raise ServerBusyError("the server is starting", starting=True)
            if self._stopping or not self.alive:
                raise ServerBusyError("the server is not taking requests now (stopping or failed)")
            self._queue.append((request, future))
            self._condition.notify()
        return future

    def start(self, show_progress: bool = True) -> None:
        """Runs the engine (`run`) on a thread of its own."""
        self.alive = True
        threading.Thread(target=self.run, args=(show_progress,), name=f"neuron-{self.name}",
                         daemon=True).start()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Waits until the engine serves.

        Raises:
            RuntimeError: the engine failed while starting, or is not ready after `timeout` seconds.
        """
        if not self.ready.wait(timeout) or self.failure is not None:
            raise RuntimeError(f"the {self.name} engine is not ready") from self.failure

    def stop(self, timeout: float | None = None) -> None:
        """Takes no more requests; those queued are served before `run` returns."""
        with self._condition:
            self._stopping = True
            self._condition.notify_all()

    def run(self, show_progress: bool = True) -> None:
        """Compiles (or loads) every graph, sets `ready`, then serves what is submitted until `stop()`."""
        self.alive = True
        try:
            with self.device_context():
                self.warm_up(show_progress)
                self.ready.set()
                while (jobs := self._next_jobs()) is not None:
                    self.serve(jobs)
        except BaseException as error:
            self.failure = error
            logger.exception("the %s engine failed", self.name)
            for _, future in self._queue:
                future.set_exception(self.stopped(error))
        finally:
            self.alive = False
            self.ready.set()

    def stopped(self, error: BaseException) -> RuntimeError:
        """The error a job gets when the device fails under it."""
        return RuntimeError(f"the {self.name} engine stopped: {error!r}")

    def _next_jobs(self) -> list[Job] | None:
        """The jobs of the next turn (waiting for one), or None once stopped and drained."""
        with self._condition:
            while not self._queue and not self._stopping:
                self._condition.wait()
            if not self._queue:
                return None
            count = len(self._queue) if self.jobs_per_turn is None else min(self.jobs_per_turn, len(self._queue))
            return [self._queue.popleft() for _ in range(count)]
