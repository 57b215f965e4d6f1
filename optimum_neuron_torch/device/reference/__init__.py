"""The reference `neuron` device: a PrivateUse1 backend in host memory, used when TorchNeuron is
not installed. It mirrors TorchNeuron's API (`torch.neuron`) and its limits (a support profile
whose other ops take a counted CPU fallback path)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import BackendUnavailableError, ReferenceDeviceBuildError
from ...settings import FALLBACK_MODES, ReferenceDeviceSettings, reference_device_settings
from . import distributed, torch_module
from .build import load_extension
from .profiles import DEVICE_ONLY_OPS, VIEW_OPS, Profile, load_profile, shipped_op_list

DEVICE_NAME = "neuron"
# The torch families the reference device is tested with (TorchNeuron 2.33 ships for 2.13 and 2.14;
# PyPI's torch 2.14 is a CUDA build, so CI stays on 2.13).
TESTED_TORCH = ("2.13",)


@dataclass
class ReferenceState:
    """What the activated reference device runs with."""

    extension: Any
    settings: ReferenceDeviceSettings
    profile: Profile


_state: ReferenceState | None = None


def activate() -> ReferenceState:
    """Builds (or loads) the extension and registers it as PyTorch's `neuron` device. Idempotent.

    The caller has checked that PrivateUse1 is free: loading a second backend aborts the process.
    """
    global _state
    if _state is not None:
        return _state
    settings = reference_device_settings()
    profile = load_profile(settings.profile)
    _warn_if_untested_torch()
    extension = load_extension()
    _check_fallback_modes(extension)

    extension.set_device_count(settings.device_count)
    extension.set_default_device(settings.default_device)
    extension.set_capacity(settings.device_memory)
    torch.utils.rename_privateuse1_backend(DEVICE_NAME)
    extension.register_hooks()
    torch_module._bind(extension)
    torch._register_device_module(DEVICE_NAME, torch_module)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    # (No default autocast dtype of its own: TorchNeuron sets none, so `torch.autocast("neuron")` takes
    # torch's default for the device, float16, in every thread; Trainer's bf16 passes its dtype.)

    # Ops a backend implements run as themselves rather than decomposed, as on TorchNeuron.
    implemented = profile.native_ops if profile.native_ops is not None else shipped_op_list()
    extension.route_through_device(sorted(implemented | DEVICE_ONLY_OPS))

    # The `neuron` process-group backend, registered at activation as `import torch_neuronx` does.
    distributed.register(extension.host_view)

    _state = ReferenceState(extension, settings, profile)
    set_profile(profile)
    extension.set_fallback_copies(settings.fallback_copies)
    return _state


def _warn_if_untested_torch() -> None:
    family = ".".join(torch.__version__.split(".")[:2])
    if family not in TESTED_TORCH:
        warnings.warn(
            f"The reference neuron device is tested with torch {', '.join(TESTED_TORCH)}, "
            f"not torch {torch.__version__}: "
            "building it anyway. When something fails, include `optimum-cli neuron-torch env` in the report.",
            stacklevel=5,
        )


class _OpTracker:
    """The reference device's op tracking, with the names of TorchNeuron's (`torch_neuronx.get_fallback_ops`...)."""

    def get_fallback_ops(self) -> list[str]:
        return [op for op, _, _ in state().extension.fallback_counts()]

    def get_executed_ops(self) -> list[str]:
        return list(state().extension.executed_ops())

    def clear_op_tracking(self) -> None:
        state().extension.clear_op_tracking()


def op_tracker() -> _OpTracker:
    """What records the ops that ran natively and those that fell back."""
    return _OpTracker()


def state() -> ReferenceState:
    if _state is None:
        raise BackendUnavailableError(
            "the reference neuron device is not active: import optimum_neuron_torch first (with "
            "OPTIMUM_NEURON_TORCH_BACKEND=auto or reference)."
        )
    return _state


def set_profile(profile: Profile | str) -> Profile:
    """Switches the support profile (`torchneuron`, `full`, or an op-list path) for the process."""
    current = state()
    if isinstance(profile, str):
        profile = load_profile(profile)
    ops = sorted(profile.native_ops | VIEW_OPS) if profile.native_ops is not None else []
    current.extension.set_profile(profile.native_ops is None, ops)
    current.profile = profile
    return profile


def _check_fallback_modes(extension: Any) -> None:
    """The C++ extension names its fallback modes (an enum): they must be the library's."""
    names = set(extension.FallbackMode.__members__)
    if names != set(FALLBACK_MODES):
        raise ReferenceDeviceBuildError(
            f"the reference device's C++ fallback modes {sorted(names)} "
            f"differ from the library's {list(FALLBACK_MODES)}: "
            "the extension and the Python package come from different versions; reinstall optimum-neuron-torch."
        )


def set_fallback_mode(mode: str) -> None:
    """`warn` (one warning per op), `error` (a fallback raises) or `silent`, applied by the C++
    fallback path to every op call (the enum member of the same name). The mode is checked by the
    caller, `ReferenceBackend.set_fallback_mode` (`device/backends.py`)."""
    state().extension.set_fallback_mode(state().extension.FallbackMode.__members__[mode])


def fallback_mode() -> str:
    return state().extension.fallback_mode().name


def set_fallback_copies(copies: bool) -> None:
    """When true, the fallback path copies inputs to the CPU and results back, as TorchNeuron does."""
    state().extension.set_fallback_copies(bool(copies))


def fallback_counts() -> dict[str, tuple[int, float]]:
    """{op: (calls, seconds)} for every op that took the fallback path since the last clear."""
    return {op: (calls, ns / 1e9) for op, calls, ns in sorted(state().extension.fallback_counts())}


def transfer_counts() -> dict[str, int]:
    """What crossed between host and device since the last clear: `host_to_device_bytes`,
    `device_to_host_bytes`, `host_to_device_copies` and `synchronizations` (copies to the host and
    `.item()` calls: the host waited for the device). Reference device only: TorchNeuron has no
    such counters."""
    return dict(state().extension.transfer_counts())


def clear_transfer_counts() -> None:
    state().extension.clear_transfer_counts()
