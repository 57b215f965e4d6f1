"""`rope_on_device`: rotary embeddings that recompute their frequencies inside `forward` create
them on the module's device rather than on the CPU.

PhiMoE's rotary embedding calls its `rope_init_fn` on every forward: `torch.arange` without a
device makes the frequencies on the CPU, and `.to(x.device)` then copies them to the device. In a
compiled graph that copy is a `prims.device_put`, which has no StableHLO lowering, so the whole
forward cannot compile. Run with the module's device as the default device (a `DeviceContext`, the
mode `with torch.device(...)` enters, which Dynamo traces), the same factories make the same values
where the module lives, and the copy becomes a no-op.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.utils._device import DeviceContext

from .registry import ModelPatch, Undo, forwards_under_mode, names_used, undo_all


def _recomputes_frequencies(cls: type) -> bool:
    """Whether the class's forward (not only its `__init__`) calls `rope_init_fn`."""
    return "rope_init_fn" in names_used(cls)


def _recomputing_modules(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if _recomputes_frequencies(type(module))]


def _device_of(module: nn.Module) -> torch.device:
    """Where the module's buffers (its `inv_freq`) live; read at each call, so moving the model
    after patching it is followed."""
    tensor = next(itertools.chain(module.buffers(), module.parameters()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _frequencies_on_device(model: nn.Module) -> Undo:
    return undo_all([forwards_under_mode([module], lambda module=module: DeviceContext(_device_of(module)))
                     for module in _recomputing_modules(model)])


PATCH = ModelPatch(
    name="rope_on_device",
    description="Rotary embeddings that recompute their frequencies in forward (PhiMoE) create them on the module's "
                "device, not on the CPU: the host-to-device copy they made has no StableHLO lowering.",
    architectures=("phimoe",),
    applies=lambda model: bool(_recomputing_modules(model)),
    apply=_frequencies_on_device,
)
