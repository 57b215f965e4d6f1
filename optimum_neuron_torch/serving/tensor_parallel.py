"""Serving a model split between ranks (`serve --tp-size N`): rank 0 runs the server and the
schedule; every other rank runs the same device calls, in the same order, with the same inputs
(the uniform numbers of sampled rows included), so that the ranks' collectives meet.

Each call's host inputs (a few hundred bytes: token ids, positions, sampling rows) go from rank 0
to the others with `broadcast_object_list` over a gloo group of its own, before rank 0 runs it;
`None` tells the others to stop.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

# A server may wait for its next request for days: the followers wait for rank 0 that long (a rank
# that exits is seen by torch's launcher, which stops the job).
IDLE_TIMEOUT = datetime.timedelta(days=365)


class StepBroadcast:
    """The channel from rank 0's engine to the other ranks' engines. Every rank creates it, at the
    same point (it creates a process group)."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def send(self, call: tuple[Any, ...] | None) -> None:
        """On rank 0: the call the other ranks run next (None: stop)."""
        dist.broadcast_object_list([call], src=0, group=self.group)

    def receive(self) -> tuple[Any, ...] | None:
        """On the other ranks: the next call rank 0 runs (None: stop)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
