"""Python objects between ranks (what `all_gather_object` and `broadcast_object_list` carry), through
the job's rendezvous store.

torch.distributed's object collectives pickle each object into a byte tensor on the device of the
group's backend. On TorchNeuron's `neuron` process group every collective runs as a program compiled
for its shapes (`torch_neuronx/distributed/backend.py`: `all_gather_op`, `all_reduce_op`), so every
new pickled size would cost a compilation on Trn, minutes each. The library's own messages (how a
step went on each rank, compile-cache keys, random states) are a few kilobytes: they go through the
key-value store every process group already has (the one `init_process_group` rendezvoused on), on
the host, with no compilation and no second process group, the same code on both backends.

Each exchange writes its keys under a name no earlier exchange of the group used (every rank makes
the same exchanges in the same order, as for any collective), and the last rank to read them deletes
them, so a long-running job (a tensor-parallel server sampling for every request) leaves nothing
behind in the store.
"""

from __future__ import annotations

import itertools
import pickle
import threading
import weakref
from typing import Any

import torch.distributed as dist

from .errors import RankFailedError

# The number of exchanges each process group has made, which names the next one's keys.
_EXCHANGES: weakref.WeakKeyDictionary[dist.ProcessGroup, itertools.count] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _store_and_prefix(group: dist.ProcessGroup) -> tuple[dist.Store, str]:
    """The store of `group` (keys under the group's own prefix) and the prefix of its next exchange."""
    # torch.distributed keeps each group's store (a PrefixStore of the rendezvous store) in its world
    # state and has no public accessor; `_store_based_barrier` reads it the same way.
    store = dist.distributed_c10d._get_process_group_store(group)
    with _LOCK:
        exchange = next(_EXCHANGES.setdefault(group, itertools.count()))
    return store, f"optimum_neuron_torch/{exchange}/"


def _exchange(group: dist.ProcessGroup | None, value: Any, senders: list[int], what: str) -> list[Any]:
    """Writes `value` if this rank is one of `senders` (ranks of `group`), then reads every sender's."""
    group = group or dist.group.WORLD
    store, prefix = _store_and_prefix(group)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    keys = [f"{prefix}{sender}" for sender in senders]
    if rank in senders:
        store.set(f"{prefix}{rank}", pickle.dumps(value))
    try:
        store.wait(keys)  # the store's timeout: the one the group was created with
    except dist.DistStoreError as error:
        missing = [sender for sender, key in zip(senders, keys, strict=True) if not store.check([key])]
        raise RankFailedError(
            f"rank {dist.get_rank()} waited {store.timeout.total_seconds():.0f} s for rank(s) {missing} of its "
            f"process group at {what}: they failed or stopped before it (see their logs)"
        ) from error
    values = [pickle.loads(data) for data in store.multi_get(keys)]
    if store.add(f"{prefix}read", 1) == size:  # every rank has read: the last one cleans up
        for key in [*keys, f"{prefix}read"]:
            store.delete_key(key)
    return values


def all_gather(value: Any, group: dist.ProcessGroup | None = None, what: str = "a message") -> list[Any]:
    """Every rank's `value`, through the rendezvous store (see the module's docstring). Every rank of
    `group` calls it, in the same order as its other exchanges.

    Args:
        value: a picklable object (a few kilobytes at most: the store holds it).
        group: the ranks (default: the whole job's).
        what: what the exchange is for, named in the error if a rank never comes.

    Returns:
        The values of the ranks of `group`, in their order.

    Raises:
        RankFailedError: a rank of `group` did not take part within the group's timeout.
    """
    return _exchange(group, value, list(range(dist.get_world_size(group or dist.group.WORLD))), what)


def broadcast(value: Any, group: dist.ProcessGroup | None = None, what: str = "a message") -> Any:
    """The first rank's `value`, on every rank of `group`, through the rendezvous store (see the
    module's docstring). Every rank of `group` calls it, in the same order as its other exchanges.

    Args:
        value: a picklable object (what the other ranks pass is ignored).
        group: the ranks (default: the whole job's).
        what: what the exchange is for, named in the error if the first rank never comes.

    Returns:
        The value of the first rank of `group`.

    Raises:
        RankFailedError: the first rank of `group` did not send within the group's timeout.
    """
    return _exchange(group, value, [0], what)[0]


def barrier(group: dist.ProcessGroup | None = None, what: str = "a barrier") -> None:
    """Returns once every rank of `group` has called it (TorchNeuron's barrier exists for the default
    group only: `torch_neuronx/distributed/backend.py`, `barrier`).

    Raises:
        RankFailedError: a rank of `group` did not arrive within the group's timeout.
    """
    all_gather(None, group, what)
