"""What compiled generation does differently for a model split between ranks (tensor parallelism):
every rank runs the same steps with the same inputs, so every random draw must be the same on all
of them, and each rank compiles (and saves) its own graphs, which DTensor specializes to its place
in the mesh."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from .. import object_collectives


def tensor_parallel_mesh(model: PreTrainedModel) -> DeviceMesh | None:
    """The mesh the model's parameters are split over, or None for a model on one device."""
    for parameter in model.parameters():
        if isinstance(parameter, DTensor):
            return parameter.device_mesh
    return None


def whole_graphs_reason(model: PreTrainedModel) -> str | None:
    """Why generation compiles `model`'s graphs whole rather than a decoder layer at a time
    (`compiler.regions`), or None. A model split between ranks compiles whole graphs: a layer region
    whose inputs are DTensors does not lower to StableHLO (AOT export refuses a traceable tensor
    subclass, so TorchNeuron could not compile it), and a traced function holding such regions cannot
    be saved for warm starts (its graph's fake values cannot be computed again: "FakeTensorMode should
    not be set when dispatching invoke_subgraph"). Whole graphs have neither problem (measured on 2
    ranks, torch 2.13)."""
    return "tensor parallelism" if tensor_parallel_mesh(model) is not None else None


def share_random_state(mesh: DeviceMesh) -> None:
    """Gives every rank of `mesh` the random states of its first rank, the CPU's (every random op on
    `neuron`, sampling among them, draws from it, as on TorchNeuron) and the `neuron` generator's
    (which DTensor's random ops move), so that sampling draws the same tokens everywhere: ranks that
    sampled apart would feed the collectives different sequences. Under `torch.manual_seed(s)` on
    every rank this changes nothing."""
    device_state, host_state = object_collectives.broadcast(
        (torch.neuron.get_rng_state(), torch.get_rng_state()), mesh.get_group(), "sharing random states"
    )
    torch.neuron.set_rng_state(device_state)
    torch.set_rng_state(host_state)


def gather_keys(mesh: DeviceMesh | None, keys: set[str]) -> list[str]:
    """The compile-cache keys of every rank's graphs (each rank's own: see the module's docstring)."""
    if mesh is None:
        return sorted(keys)
    return sorted(set().union(*object_collectives.all_gather(keys, mesh.get_group(), "gathering compile-cache keys")))


@contextlib.contextmanager
def embeddings_without_padding_index(model: PreTrainedModel) -> Iterator[None]:
    """Unsets `padding_idx` on the split embeddings while compiled generation runs. It only keeps the
    padding row's gradient at zero, and generation computes no gradient; DTensor's embedding with
    a padding index does not compile (Phi-3, whose `pad_token_id` becomes the embedding's)."""
    changed = [module for module in model.modules()
               if isinstance(module, torch.nn.Embedding) and isinstance(module.weight, DTensor)
               and module.padding_idx is not None]
    indices = [module.padding_idx for module in changed]
    for module in changed:
        module.padding_idx = None
    try:
        yield
    finally:
        for module, index in zip(changed, indices, strict=True):
            module.padding_idx = index


# Serving a split model (`serve --tp-size N`): rank 0 runs the server and the schedule; every
# other rank runs the same device calls, in the same order, with the same inputs (the uniform
# numbers of sampled rows included), sent before rank 0 runs each (a few hundred bytes, over a gloo
# group of its own; `None` tells the others to stop), so that the ranks' collectives meet.
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
