"""Python objects between ranks (what `all_gather_object` and `broadcast_object_list` carry), over a
gloo group of the same ranks.

torch.distributed pickles each object into a byte tensor on the device of the group's backend. On
TorchNeuron's `neuron` process group every collective runs as a program compiled for its shapes
(`torch_neuronx/distributed/backend.py`: `all_gather_op`, `all_reduce_op`), so every new pickled size
would cost a compilation on Trn, minutes each. The library's own messages (how a step went on each
rank, compile-cache keys, random states) therefore go through a gloo group over the same ranks:
host memory, no compilation, the same code on both backends.
"""

from __future__ import annotations

import threading
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import settings

# The gloo group created for each device group, kept as long as the device group lives.
_HOST_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def host_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """A process group over the ranks of `group` whose collectives stay on the host: `group` itself
    when its backend is gloo (or has a CPU part, `"cpu:gloo,neuron:neuron"`), else a gloo group
    created once for it.

    Its first use creates a process group, which every rank of the job does at the same point (as
    `torch.distributed.new_group` requires): call it where every rank calls the collective that
    follows, as the functions below are called.

    Args:
        group: the process group (default: the whole job's).

    Returns:
        The group to hand the object collectives.
    """
    group = group or dist.group.WORLD
    backend = dist.get_backend(group)
    if backend == "gloo" or "cpu:" in backend:
        return group
    with _LOCK:
        if group not in _HOST_GROUPS:
            _HOST_GROUPS[group] = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo",
                                                 timeout=timedelta(seconds=settings.distributed_timeout()))
        return _HOST_GROUPS[group]


def all_gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `value`, over the host (see `host_group`).

    Args:
        value: a picklable object.
        group: the ranks (default: the whole job's).

    Returns:
        The values of the ranks of `group`, in their order.
    """
    group = host_group(group)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def broadcast(value: Any, group: dist.ProcessGroup | None = None) -> Any:
    """The first rank's `value`, on every rank, over the host (see `host_group`).

    Args:
        value: a picklable object (what the other ranks pass is ignored).
        group: the ranks (default: the whole job's).

    Returns:
        The value of the first rank of `group`.
    """
    box = [value]
    dist.broadcast_object_list(box, group_src=0, group=host_group(group))
    return box[0]
