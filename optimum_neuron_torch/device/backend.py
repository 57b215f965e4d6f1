"""Choosing the process's `neuron` backend: TorchNeuron when it is there, else the reference device.

The choice is made once per process. `OPTIMUM_NEURON_TORCH_BACKEND=auto|torchneuron|reference`
forces it. Nothing else in the library needs to know which backend is active.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass

import torch

from ..errors import BackendConflictError, BackendUnavailableError, ConfigurationError

BACKEND_ENV = "OPTIMUM_NEURON_TORCH_BACKEND"
BACKENDS = ("auto", "torchneuron", "reference")
TORCHNEURON_MODULE = "torch_neuronx"
_UNCLAIMED = "privateuseone"


@dataclass(frozen=True)
class BackendInfo:
    """The active backend: its name, version, support profile and devices."""

    name: str  # "torchneuron" or "reference"
    version: str
    profile: str
    device_count: int
    device_memory: int
    fallback: str
    torch_version: str = torch.__version__

    def __str__(self) -> str:
        return (
            f"{self.name} {self.version} (profile {self.profile}, {self.device_count} device(s) of "
            f"{self.device_memory / 2**30:.1f} GiB, fallback {self.fallback}, torch {self.torch_version})"
        )


_active: BackendInfo | None = None


def _requested() -> str:
    requested = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if requested not in BACKENDS:
        raise ConfigurationError(f"{BACKEND_ENV}={requested!r} must be one of {', '.join(BACKENDS)}.")
    return requested


def _privateuse1_owner() -> str | None:
    """Who holds PyTorch's PrivateUse1 slot: None when free, else a description."""
    name = torch._C._get_privateuse1_backend_name()
    if name != _UNCLAIMED:
        return f"a backend named {name!r}"
    accelerator = torch._C._get_accelerator()
    if accelerator.type == _UNCLAIMED:
        return "an unnamed PrivateUse1 backend"
    return None


def _torchneuron_present() -> bool:
    return importlib.util.find_spec(TORCHNEURON_MODULE) is not None or (
        torch._C._get_privateuse1_backend_name() == "neuron" and hasattr(torch, "neuron") and not _is_reference()
    )


def _is_reference() -> bool:
    module = getattr(torch, "neuron", None)
    return getattr(module, "__name__", "").startswith(__package__)


def _activate_torchneuron() -> BackendInfo:
    try:
        module = importlib.import_module(TORCHNEURON_MODULE)
    except ImportError as error:
        raise BackendUnavailableError(
            f"{BACKEND_ENV}=torchneuron, but TorchNeuron ({TORCHNEURON_MODULE}) cannot be imported: {error}. "
            f"It is installed on Trn instances from the Neuron SDK; elsewhere use {BACKEND_ENV}=reference or auto."
        ) from error
    if not hasattr(torch, "neuron"):
        raise BackendUnavailableError(f"{TORCHNEURON_MODULE} imported but registered no torch.neuron module.")
    count = torch.neuron.device_count()
    memory = torch.neuron.get_device_properties(0).total_memory if count else 0
    return BackendInfo(
        name="torchneuron",
        version=getattr(module, "__version__", "unknown"),
        profile="hardware",
        device_count=count,
        device_memory=memory,
        fallback="cpu",
    )


def _activate_reference() -> BackendInfo:
    if not _is_reference():
        owner = _privateuse1_owner()
        if owner is not None:
            raise BackendConflictError(
                f"cannot register the reference neuron device: PyTorch's PrivateUse1 device slot is already "
                f"owned by {owner}. Only one such backend fits in a process; import optimum_neuron_torch in a "
                "process that does not load the other one."
            )
    from . import reference

    state = reference.activate()
    from .. import __version__

    return BackendInfo(
        name="reference",
        version=__version__,
        profile=state.profile.name,
        device_count=state.settings.device_count,
        device_memory=state.settings.device_memory,
        fallback=state.settings.fallback,
    )


def activate() -> BackendInfo:
    """Activates the backend once per process and returns what is active."""
    global _active
    if _active is None:
        requested = _requested()
        if requested == "torchneuron" or (requested == "auto" and _torchneuron_present()):
            _active = _activate_torchneuron()
        else:
            _active = _activate_reference()
    return _active
