"""What compiled generation does differently for a model split between ranks (tensor parallelism):
every rank runs the same steps with the same inputs, so every random draw must be the same on all
of them, and each rank compiles (and saves) its own graphs, which DTensor specializes to its place
in the mesh."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
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
    (`compiler.regions`), or None. A model split between ranks compiles whole graphs: its graphs
    saved with `save_pretrained()` did not all load again on every rank when compiled a layer at a
    time (measured on 2 ranks: rank 1 compiled 4 of its 6 programs again), not yet understood."""
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
