"""Which ops ran natively on the `neuron` device and which fell back to the CPU, as the backend
records them (TorchNeuron's op tracker, or the reference device's, which also counts calls and
seconds)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .selection import activate


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
    return sorted(activate().op_tracker().get_fallback_ops())


def executed_ops() -> list[str]:
    """Ops that ran natively on the device since start or the last `clear_op_tracking()`.

    Returns:
        Their ATen names, sorted, each once.

    Example:
        >>> "aten::addmm" in optimum_neuron_torch.executed_ops()
        True
    """
    _wait_for_queued_ops()
    return sorted(activate().op_tracker().get_executed_ops())


def clear_op_tracking() -> None:
    """Forgets the ops recorded so far: both `fallback_ops()` and `executed_ops()` start empty
    (and the reference device's `fallback_stats()` counts from zero).

    Example:
        >>> optimum_neuron_torch.clear_op_tracking()
        >>> optimum_neuron_torch.fallback_ops()
        []
    """
    activate().op_tracker().clear_op_tracking()


@dataclass(frozen=True)
class FallbackStats:
    """Calls of one op on the fallback path and the seconds they took (what `fallback_stats()` gives
    per op).

    Args:
        calls (`int` or `None`): how many times the op ran on the CPU; None where the backend does not
            count them (TorchNeuron records op names only).
        seconds (`float` or `None`): the time those calls took on the fallback path; None where the
            backend does not count them.

    Example:
        >>> stats = optimum_neuron_torch.fallback_stats()["aten::cumprod.out"]
        >>> stats.calls, stats.seconds
        (4, 0.0012)
    """

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
    _wait_for_queued_ops()
    return {op: FallbackStats(calls, seconds) for op, (calls, seconds) in sorted(activate().fallback_counts().items())}
