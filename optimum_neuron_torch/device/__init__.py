"""The `neuron` device, whichever backend provides it.

Importing this package activates the backend (TorchNeuron when installed, else the reference
device), after which `torch.device("neuron")`, `tensor.to("neuron")` and `torch.neuron` work.
`torch.neuron` offers TorchNeuron's functions only, on both backends; what the library needs
beyond them is here and works the same on both: the backend (`backend_info()`), free device
memory, support profiles, and the ops that ran natively or fell back (`op_tracking`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .backends import Backend
from .op_tracking import FallbackStats, clear_op_tracking, executed_ops, fallback_ops, fallback_stats
from .selection import activate


def backend_info() -> Backend:
    """The backend that provides the `neuron` device in this process: the one object that answers
    every question whose answer differs between TorchNeuron and the reference device.

    Returns:
        `Backend`: its name (`torchneuron` or `reference`), version, device count, the support
        profile and fallback policy in force now, and what differs between the backends (see
        `backends.Backend`).

    Raises:
        BackendUnavailableError: the backend asked for (`OPTIMUM_NEURON_TORCH_BACKEND`) cannot be
            activated (raised at `import optimum_neuron_torch` already).

    Example:
        >>> print(optimum_neuron_torch.backend_info())
        reference 0.1.0.dev0 (profile torchneuron, 1 device(s) of 24.0 GiB, fallback warn, torch 2.13.0+cpu)
    """
    return activate()


@contextlib.contextmanager
def support_profile(name: str) -> Iterator[None]:
    """The reference device's support profile `name` (`torchneuron`, `full` or an op-list path)
    inside the block; on TorchNeuron the hardware decides and nothing changes.

    Example:
        >>> with support_profile("torchneuron"):
        ...     model(**inputs)  # ops outside TorchNeuron's native set fall back, as on Trainium
    """
    with activate().support_profile(name):
        yield


def mem_get_info(device: torch.device | str | int | None = None) -> tuple[int, int]:
    """(free, total) memory of a `neuron` device in bytes: its capacity less what tensors and the
    allocator's cache hold.

    TorchNeuron's `memory_reserved()` is always 0 (it has no caching allocator), so what is allocated
    counts too. Its `get_device_properties(i).total_memory` is 0 when the runtime cannot answer (from
    the local rank 1 of a job on, it asks for a core by the wrong index): `(0, 0)` then means
    "unknown", never "no memory".

    Args:
        device: a `neuron` device or its index (default: the current device).

    Returns:
        `(free, total)`, or `(0, 0)` when the backend does not know. On TorchNeuron, reading the
        capacity starts its runtime.

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
    if not total:
        return 0, 0
    held = max(torch.neuron.memory_reserved(index), torch.neuron.memory_allocated(index))
    return max(total - held, 0), total


__all__ = [
    "Backend",
    "FallbackStats",
    "backend_info",
    "clear_op_tracking",
    "executed_ops",
    "fallback_ops",
    "fallback_stats",
    "mem_get_info",
    "support_profile",
]
