"""The `neuron` device, whichever backend provides it.

Importing this package activates the backend (TorchNeuron when installed, else the reference
device), after which `torch.device("neuron")`, `tensor.to("neuron")` and `torch.neuron` work.
The op-tracking functions below work the same on both backends.
"""

from __future__ import annotations

import torch

from .backend import BACKEND_ENV, BackendInfo, activate


def backend_info() -> BackendInfo:
    """The active backend, its version and support profile."""
    return activate()


def _tracker():
    if activate().name == "torchneuron":
        import torch_neuronx

        return torch_neuronx
    return torch.neuron


def fallback_ops() -> list[str]:
    """Ops that fell back to the CPU since start or the last `clear_op_tracking()`."""
    return sorted(_tracker().get_fallback_ops())


def executed_ops() -> list[str]:
    """Ops that ran natively on the device since start or the last `clear_op_tracking()`."""
    return sorted(_tracker().get_executed_ops())


def clear_op_tracking() -> None:
    _tracker().clear_op_tracking()


__all__ = ["BACKEND_ENV", "BackendInfo", "backend_info", "clear_op_tracking", "executed_ops", "fallback_ops"]
