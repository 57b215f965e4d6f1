"""The `neuron` device, whichever backend provides it.

Importing this package activates the backend (TorchNeuron when installed, else the reference
device), after which `torch.device("neuron")`, `tensor.to("neuron")` and `torch.neuron` work.
`torch.neuron` offers TorchNeuron's functions only, on both backends; what the library needs
beyond them (free device memory, op tracking) is here and works the same on both.
"""

from __future__ import annotations

from types import ModuleType

import torch

from .backend import BACKEND_ENV, BackendInfo, activate


def backend_info() -> BackendInfo:
    """The active backend, its version and support profile."""
    return activate()


def _tracker() -> ModuleType:
    """What records op names: TorchNeuron's top-level module, or the reference device's extension."""
    if activate().name == "torchneuron":
        import torch_neuronx

        return torch_neuronx
    from . import reference

    return reference.op_tracker()


def _wait_for_queued_ops() -> None:
    """In TorchNeuron's asynchronous mode an op is recorded when it runs: wait for queued work first
    (a runtime not started has none, and is not started by asking)."""
    if torch.neuron.is_initialized():
        torch.neuron.synchronize()


def fallback_ops() -> list[str]:
    """Ops that fell back to the CPU since start or the last `clear_op_tracking()`, sorted."""
    _wait_for_queued_ops()
    return sorted(_tracker().get_fallback_ops())


def executed_ops() -> list[str]:
    """Ops that ran natively on the device since start or the last `clear_op_tracking()`, sorted."""
    _wait_for_queued_ops()
    return sorted(_tracker().get_executed_ops())


def clear_op_tracking() -> None:
    """Forgets the ops recorded so far (both lists)."""
    _tracker().clear_op_tracking()


def mem_get_info(device: torch.device | str | int | None = None) -> tuple[int, int]:
    """(free, total) memory of a `neuron` device in bytes: its capacity less what the allocator holds.

    Args:
        device: a `neuron` device or its index (default: the current device).

    Returns:
        `(free, total)`. On TorchNeuron, reading the capacity starts its runtime.

    Example:
        >>> free, total = optimum_neuron_torch.device.mem_get_info()
    """
    if device is None:
        index = torch.neuron.current_device()
    elif isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        index = torch.neuron.current_device() if device.index is None else device.index
    total = torch.neuron.get_device_properties(index).total_memory
    return max(total - torch.neuron.memory_reserved(index), 0), total


__all__ = [
    "BACKEND_ENV",
    "BackendInfo",
    "backend_info",
    "clear_op_tracking",
    "executed_ops",
    "fallback_ops",
    "mem_get_info",
]
