"""A collective in flight on the reference device's `neuron` process group (`distributed`): gloo's
work, the device tensors it writes, failures that name ranks, and the host views gloo worked on,
released before the process may exit."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch._C._distributed_c10d import Work, _create_work_from_future

from ...errors import CollectiveError

if TYPE_CHECKING:
    from .distributed import ProcessGroupNeuron


class NeuronWork(Work):
    """A collective in flight: gloo's work, the device tensors it writes, and failures that name ranks."""

    def __init__(self, inner: Work, group: ProcessGroupNeuron, op: str, outputs: list[torch.Tensor],
                 keep_alive: Sequence[Any] = (), after: Callable[[], None] | None = None):
        super().__init__()
        self._inner = inner
        self._group = group
        self._op = op
        self._outputs = outputs
        self._keep_alive = keep_alive  # the host views gloo reads and writes, until it is done
        self._after = after  # what completes the op on the device once gloo is done (copies out)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._inner is None:  # waited before
            return True
        try:
            done = self._inner.wait(timeout) if timeout else self._inner.wait()
        except RuntimeError as error:
            raise self._group._failure(self._op, error) from error
        self._finish()
        return done

    def _finish(self) -> None:
        if self._after is not None:
            after, self._after = self._after, None
            after()
        self._inner = None
        _await_release(self._keep_alive)

    def is_completed(self) -> bool:
        return self._inner is None or self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner is None or self._inner.is_success()

    def exception(self) -> Any:
        return None if self._inner is None else self._inner.exception()

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        """A future of the device outputs. It is completed here, by waiting: a Python callback
        chained on gloo's future runs on gloo's thread and can outlive the interpreter (an abort at
        exit), and the reference device computes on the host anyway."""
        future: torch.futures.Future = torch.futures.Future()
        try:
            self.wait()
        except CollectiveError as error:
            future.set_exception(error)
        else:
            future.set_result(self._outputs)
        return future


class DoneWork(NeuronWork):
    """An op with nothing to exchange (a group of one, empty tensors)."""

    def __init__(self, group: ProcessGroupNeuron, op: str, outputs: list[torch.Tensor]):
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(outputs)
        super().__init__(_create_work_from_future(future), group, op, outputs)


# Host views whose gloo work outlived the wait below: kept for the process's life rather than let
# gloo's thread free them (see `_await_release`). Stays empty in practice.
_ORPHANED_VIEWS: list[Any] = []
_RELEASE_SECONDS = 5.0


def _await_release(views: Any) -> None:
    """Waits until gloo's worker thread has dropped its own references to the host views of a finished
    op, so that the last reference to each is this process's Python one.

    gloo's worker marks an op done and only then destroys it, with the tensors it holds. If Python has
    dropped the views by then, the worker frees their Python objects, which needs the GIL: at the
    interpreter's exit that kills the thread inside a destructor and aborts the process ("terminate
    called without an active exception", 3 of about 25 two-rank Trainer runs that ended without
    `destroy_process_group`). The wait is usually nothing: the worker is done before `wait()` returns.
    """
    tensors = list(_flatten(views))
    deadline = None
    while any(tensor._use_count() > 1 for tensor in tensors):
        if deadline is None:
            deadline = time.monotonic() + _RELEASE_SECONDS
        elif time.monotonic() > deadline:  # another holder (not gloo's): never freed on gloo's thread
            _ORPHANED_VIEWS.append(tensors)
            return
        time.sleep(0)  # lets gloo's worker run


def _flatten(views: Any) -> Iterable[torch.Tensor]:
    if isinstance(views, torch.Tensor):
        yield views
    elif isinstance(views, (list, tuple)):
        for view in views:
            yield from _flatten(view)
