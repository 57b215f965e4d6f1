"""The `neuron` device, whichever backend provides it.

Importing this package activates the backend (TorchNeuron when installed, else the reference
device), after which `torch.device("neuron")`, `tensor.to("neuron")` and `torch.neuron` work.
`torch.neuron` offers TorchNeuron's functions only, on both backends; what the library needs
beyond them (free device memory, op tracking) is here and works the same on both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

from ..errors import ConfigurationError
from ..settings import FALLBACK_MODES
from .selection import BackendInfo, activate


def backend_info() -> BackendInfo:
    """The backend that provides the `neuron` device in this process.

    Returns:
        `BackendInfo`: name (`torchneuron` or `reference`), version, device count, and the support
        profile and fallback policy in force now.

    Raises:
        BackendUnavailableError: the backend asked for (`OPTIMUM_NEURON_TORCH_BACKEND`) cannot be
            activated (raised at `import optimum_neuron_torch` already).

    Example:
        >>> print(optimum_neuron_torch.backend_info())
        reference 0.1.0.dev0 (profile torchneuron, 1 device(s) of 24.0 GiB, fallback warn, torch 2.13.0+cpu)
    """
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


def fallback_ops(wait: bool = True) -> list[str]:
    """Ops that fell back to the CPU since start or the last `clear_op_tracking()` (waiting for
    queued work first, so that TorchNeuron's asynchronous mode has recorded them).

    Args:
        wait: whether to wait for queued work first; without, an op still queued is not listed yet.

    Returns:
        Their ATen names, sorted, each once (`aten::argmax.out`, ...).

    Example:
        >>> optimum_neuron_torch.clear_op_tracking()
        >>> model(**inputs)
        >>> optimum_neuron_torch.fallback_ops()
        ['aten::argmax.out']
    """
    if wait:
        _wait_for_queued_ops()
    return sorted(_tracker().get_fallback_ops())


def executed_ops() -> list[str]:
    """Ops that ran natively on the device since start or the last `clear_op_tracking()`.

    Returns:
        Their ATen names, sorted, each once.

    Example:
        >>> "aten::addmm" in optimum_neuron_torch.executed_ops()
        True
    """
    _wait_for_queued_ops()
    return sorted(_tracker().get_executed_ops())


def clear_op_tracking() -> None:
    """Forgets the ops recorded so far: both `fallback_ops()` and `executed_ops()` start empty
    (and the reference device's `fallback_stats()` counts from zero).

    Example:
        >>> optimum_neuron_torch.clear_op_tracking()
        >>> optimum_neuron_torch.fallback_ops()
        []
    """
    _tracker().clear_op_tracking()


@dataclass(frozen=True)
class FallbackStats:
    """Calls of one op on the fallback path and the seconds they took (None where the backend
    does not count them: TorchNeuron records op names only)."""

    calls: int | None
    seconds: float | None


def fallback_stats() -> dict[str, FallbackStats]:
    """Every op that fell back to the CPU since start or the last `clear_op_tracking()`, with its
    counts where the backend keeps them.

    Returns:
        `{op: FallbackStats}`, sorted by op name. The reference device counts calls and seconds;
        TorchNeuron records names only (`FallbackStats(None, None)`).

    Example:
        >>> optimum_neuron_torch.fallback_stats()
        {'aten::cumprod.out': FallbackStats(calls=4, seconds=0.0012)}
    """
    if activate().name == "reference":
        from . import reference

        return {op: FallbackStats(calls, seconds) for op, (calls, seconds) in reference.fallback_counts().items()}
    return {op: FallbackStats(None, None) for op in fallback_ops()}


# The fallback policy's mode. The reference device applies it itself, to each op call before it runs,
# so it lives in the device; TorchNeuron has no such setting (the policy acts on its op tracker), so
# the mode is kept here. Both start at `warn`; `import optimum_neuron_torch` then sets the mode that
# OPTIMUM_NEURON_TORCH_FALLBACK asks for (the fallback policy does, when it is imported).
_torchneuron_fallback_mode = "warn"


def fallback_mode() -> str:
    """The fallback policy in force: `warn`, `error` or `silent` (`fallbacks.set_fallback_policy` sets it)."""
    if activate().name == "reference":
        from . import reference

        return reference.fallback_mode()
    return _torchneuron_fallback_mode


def set_fallback_mode(mode: str) -> None:
    """Records the fallback policy's mode (the reference device applies it to every op call).

    Raises:
        ConfigurationError: `mode` is not `warn`, `error` or `silent`.
    """
    global _torchneuron_fallback_mode
    if mode not in FALLBACK_MODES:
        raise ConfigurationError(f"unknown fallback policy {mode!r}: use one of {', '.join(FALLBACK_MODES)}.")
    if activate().name == "reference":
        from . import reference

        reference.set_fallback_mode(mode)
    else:
        _torchneuron_fallback_mode = mode


@contextlib.contextmanager
def support_profile(name: str) -> Iterator[None]:
    """The reference device's support profile `name` (`torchneuron`, `full` or an op-list path)
    inside the block; on TorchNeuron the hardware decides and nothing changes.

    Example:
        >>> with support_profile("torchneuron"):
        ...     model(**inputs)  # ops outside TorchNeuron's native set fall back, as on Trainium
    """
    if activate().name != "reference":
        yield
        return
    from . import reference

    previous = reference.state().profile
    reference.set_profile(name)
    try:
        yield
    finally:
        reference.set_profile(previous)


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
    "BackendInfo",
    "FallbackStats",
    "backend_info",
    "clear_op_tracking",
    "executed_ops",
    "fallback_mode",
    "fallback_ops",
    "fallback_stats",
    "mem_get_info",
    "set_fallback_mode",
    "support_profile",
]
