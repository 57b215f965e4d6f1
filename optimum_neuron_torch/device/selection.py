"""Choosing the process's `neuron` backend: TorchNeuron when it is there, else the reference device.

The choice is made once per process. `OPTIMUM_NEURON_TORCH_BACKEND=auto|torchneuron|reference`
forces it. The rest of the library asks the `Backend` made here (see `backends.py`).

How TorchNeuron is recognised (`auto`):
- it has registered the `neuron` device already: PyTorch autoloads it at `import torch` through
  its `torch.backends` entry point (or the user imported `torch_neuronx`);
- it is installed (its `torch.backends` entry point exists) but was not autoloaded
  (`TORCH_DEVICE_BACKEND_AUTOLOAD=0`): it is imported when the machine has NeuronCores.
The XLA-based torch-neuronx of the older Neuron SDK uses the same module name but declares no such
entry point and registers no `neuron` device; with it, or on a machine without NeuronCores, the
reference device is used, with one warning.

Activation never starts TorchNeuron's runtime: a process that forks afterwards can still use the
device. Device properties are read when first asked for (`Backend.device_memory`).
"""

from __future__ import annotations

import glob
import importlib
import importlib.metadata
import importlib.util
import warnings

import torch

from ..errors import BackendConflictError, BackendUnavailableError
from ..settings import AUTOLOAD_ENV, BACKEND_ENV, requested_backend
from ..version import __version__
from .backends import Backend, ReferenceBackend, TorchNeuronBackend

TORCHNEURON_MODULE = "torch_neuronx"
# Device files the Neuron driver creates, one per Neuron device: present on a Trn instance only.
NEURON_DEVICE_FILES = "/dev/neuron[0-9]*"
_UNCLAIMED = "privateuseone"


_active: Backend | None = None


def _privateuse1_owner() -> str | None:
    """Who holds PyTorch's PrivateUse1 slot: None when free, else a description."""
    name = torch._C._get_privateuse1_backend_name()
    if name != _UNCLAIMED:
        return f"a backend named {name!r}"
    accelerator = torch._C._get_accelerator()
    if accelerator.type == _UNCLAIMED:
        return "an unnamed PrivateUse1 backend"
    return None


def _module_name() -> str:
    return getattr(getattr(torch, "neuron", None), "__name__", "")


def _is_reference() -> bool:
    return _module_name().startswith(__package__)


def torchneuron_registered() -> bool:
    """Whether TorchNeuron has registered the `neuron` device in this process."""
    return torch._C._get_privateuse1_backend_name() == "neuron" and _module_name().startswith(TORCHNEURON_MODULE)


def torchneuron_installed() -> bool:
    """Whether TorchNeuron is installed: its `torch.backends` entry point, which the XLA-based
    torch-neuronx of the same module name does not declare."""
    return any(
        entry_point.value.partition(":")[0].split(".")[0] == TORCHNEURON_MODULE
        for entry_point in importlib.metadata.entry_points(group="torch.backends")
    )


def neuron_cores_present() -> bool:
    """Whether this machine has Neuron devices, from the driver's device files (nothing is started)."""
    return bool(glob.glob(NEURON_DEVICE_FILES))


def _no_cores_error() -> BackendUnavailableError:
    return BackendUnavailableError(
        "TorchNeuron is loaded (PyTorch autoloads it at `import torch`) but sees no NeuronCores on this machine. "
        f"On a Trn instance, check the Neuron driver (`neuron-ls`) and NEURON_RT_VISIBLE_CORES. To use the reference "
        f"device here instead, start Python with {AUTOLOAD_ENV}=0 in the environment (it must be set before "
        "`import torch`), so that TorchNeuron stays unloaded."
    )


def _activate_torchneuron() -> Backend:
    if not torchneuron_registered():
        try:
            importlib.import_module(TORCHNEURON_MODULE)
        except ImportError as error:
            raise BackendUnavailableError(
                f"{BACKEND_ENV}=torchneuron, but TorchNeuron ({TORCHNEURON_MODULE}) cannot be imported: {error}. "
                f"It is installed on Trn instances from the Neuron SDK; elsewhere use {BACKEND_ENV}=reference or auto."
            ) from error
        if not torchneuron_registered():
            raise BackendUnavailableError(
                f"{TORCHNEURON_MODULE} imported but registered no `neuron` device: it is the XLA-based torch-neuronx "
                f"of the older Neuron SDK, not TorchNeuron. Install TorchNeuron from Neuron SDK 2.33 or later, or use "
                f"{BACKEND_ENV}=reference."
            )
    count = torch.neuron.device_count()
    if count == 0:
        raise _no_cores_error()
    return TorchNeuronBackend(
        version=getattr(importlib.import_module(TORCHNEURON_MODULE), "__version__", "unknown"), device_count=count
    )


def _activate_reference() -> Backend:
    if not _is_reference():
        if torchneuron_registered():
            raise BackendConflictError(
                f"{BACKEND_ENV}=reference, but TorchNeuron was autoloaded at `import torch` and owns the `neuron` "
                f"device. Start Python with {AUTOLOAD_ENV}=0 in the environment (it must be set before `import "
                "torch`) to keep TorchNeuron unloaded and use the reference device."
            )
        owner = _privateuse1_owner()
        if owner is not None:
            raise BackendConflictError(
                f"cannot register the reference neuron device: PyTorch's PrivateUse1 device slot is already "
                f"owned by {owner}. Only one such backend fits in a process; import optimum_neuron_torch in a "
                "process that does not load the other one."
            )
    from . import reference

    state = reference.activate()
    return ReferenceBackend(version=__version__, device_count=state.settings.device_count)


def _auto() -> Backend:
    """TorchNeuron where it can run, else the reference device (with a warning that says why)."""
    if torchneuron_registered():
        return _activate_torchneuron()  # no NeuronCores: an error, the `neuron` slot is TorchNeuron's
    if _is_reference() or importlib.util.find_spec(TORCHNEURON_MODULE) is None:
        return _activate_reference()  # the usual case: no entry-point scan at start-up
    if torchneuron_installed():
        if neuron_cores_present():
            return _activate_torchneuron()
        warnings.warn(
            "TorchNeuron is installed but this machine has no NeuronCores: using optimum-neuron-torch's reference "
            f"neuron device instead (set {BACKEND_ENV}=reference to silence this warning).", stacklevel=4,
        )
    else:
        warnings.warn(
            f"The installed {TORCHNEURON_MODULE} is the XLA-based torch-neuronx of the older Neuron SDK (it has no "
            "`neuron` device), not TorchNeuron: using optimum-neuron-torch's reference neuron device instead "
            f"(set {BACKEND_ENV}=reference to silence this warning).", stacklevel=4,
        )
    return _activate_reference()


def activate() -> Backend:
    """Activates the backend once per process and returns what is active."""
    global _active
    if _active is None:
        requested = requested_backend()
        if requested == "torchneuron":
            _active = _activate_torchneuron()
        elif requested == "reference":
            _active = _activate_reference()
        else:
            _active = _auto()
    return _active
