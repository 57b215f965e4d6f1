"""The backend that provides the `neuron` device, as one object: every question whose answer
differs between TorchNeuron and the reference device is asked of it (as vLLM asks its `Platform`).

`selection.activate()` makes the one `Backend` of the process; `optimum_neuron_torch.backend_info()`
returns it. The rest of the library asks what it needs (`backend.compiles_itself`,
`backend.neff_cache`, `backend.fallback_counts()`, ...) and never compares backend names
(`tests/test_layout.py` checks that no module outside this one does).
"""

from __future__ import annotations

import contextlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch

from ..errors import ConfigurationError
from ..settings import FALLBACK_MODES, neff_cache_dir


@dataclass(frozen=True)
class Backend(ABC):
    """The active backend: what it is, and what differs between the two.

    Attributes:
        name: `"torchneuron"` or `"reference"` (for display and for the compile cache's
            environment; code asks the attributes below, not the name).
        version: TorchNeuron's version, or this library's for the reference device.
        device_count: `neuron` devices this process sees.
        torch_version: PyTorch's version.
        compiles_itself: TorchNeuron compiles graphs with its own `neuron` Dynamo backend, into its
            NEFF cache, and identifies its compiler by its version; the reference device's graphs
            are compiled by the library's backend (Inductor's C++ code) into the library's compile
            cache.
        applies_policy_per_op: the fallback policy acts on each op call before it runs (the
            reference device); TorchNeuron runs a fallback and records its op name once, so the
            policy reads its tracker after the fact.
        detected_by_transformers: Transformers and accelerate switch their `neuron` branches on by
            themselves (they look for the module `torch_neuronx`).
        collective_transport: what carries the `neuron` process group's collectives.
        counts_transfers: the reference device counts the bytes copied between the host and the
            device (`device.reference.transfer_counts()`, which the benchmarks read); TorchNeuron
            does not.
        sets_defaults_at_import: TorchNeuron sets its release defaults in the environment when
            imported (`os.environ.setdefault`), which `optimum-cli neuron-torch env` tells apart
            from what the user set.

    Example:
        >>> backend = optimum_neuron_torch.backend_info()
        >>> print(backend)
        reference 0.1.0.dev0 (profile torchneuron, 1 device(s) of 24.0 GiB, fallback warn, torch 2.13.0+cpu)
        >>> backend.compiles_itself
        False
    """

    name: ClassVar[str]
    compiles_itself: ClassVar[bool]
    applies_policy_per_op: ClassVar[bool]
    detected_by_transformers: ClassVar[bool]
    collective_transport: ClassVar[str]
    sets_defaults_at_import: ClassVar[bool]
    counts_transfers: ClassVar[bool]

    version: str
    device_count: int
    torch_version: str = torch.__version__

    @property
    @abstractmethod
    def profile(self) -> str:
        """The ops that run natively: `hardware` on TorchNeuron, else the reference device's current
        support profile (`torchneuron`, `full` or an op list)."""

    @property
    def fallback(self) -> str:
        """The fallback policy in force now: `warn`, `error` or `silent` (see `set_fallback_policy`)."""
        return self.fallback_mode()

    @property
    def device_memory(self) -> int:
        """Memory of one device in bytes (0 without devices). On TorchNeuron, asking starts its runtime."""
        return torch.neuron.get_device_properties(0).total_memory if self.device_count else 0

    @property
    def neff_cache(self) -> Path | None:
        """Where the backend's own compiler keeps compiled graphs (TorchNeuron's NEFF cache), or None
        where the library's compile cache holds them (the reference device)."""
        return None

    @abstractmethod
    def op_tracker(self) -> Any:
        """What records op names (`get_fallback_ops`, `get_executed_ops`, `clear_op_tracking`)."""

    def fallback_counts(self) -> dict[str, tuple[int | None, float | None]]:
        """`{op: (calls, seconds)}` of the ops that fell back since the last `clear_op_tracking()`;
        `(None, None)` where the backend records names only."""
        return {op: (None, None) for op in self.op_tracker().get_fallback_ops()}

    @abstractmethod
    def fallback_mode(self) -> str:
        """The fallback policy's mode in force."""

    def set_fallback_mode(self, mode: str) -> None:
        """Records the fallback policy's mode (`fallbacks.set_fallback_policy` decides it).

        Raises:
            ConfigurationError: `mode` is not `warn`, `error` or `silent`.
        """
        if mode not in FALLBACK_MODES:
            raise ConfigurationError(f"unknown fallback policy {mode!r}: use one of {', '.join(FALLBACK_MODES)}.")
        self._set_fallback_mode(mode)

    @abstractmethod
    def _set_fallback_mode(self, mode: str) -> None:
        """Records a mode `set_fallback_mode` validated."""

    @contextlib.contextmanager
    def support_profile(self, name: str) -> Iterator[None]:
        """The reference device's support profile `name` inside the block; on TorchNeuron the
        hardware decides and nothing changes."""
        yield

    def __str__(self) -> str:
        return (
            f"{self.name} {self.version} (profile {self.profile}, {self.device_count} device(s)"
            f"{self._memory_text()}, fallback {self.fallback}, torch {self.torch_version})"
        )

    def _memory_text(self) -> str:
        return ""


# The fallback policy's mode on TorchNeuron, which has no such setting (the policy acts on its op
# tracker); process-wide like the reference device's. `import optimum_neuron_torch` sets the mode
# that OPTIMUM_NEURON_TORCH_FALLBACK asks for (the fallback policy does, when it is imported).
_torchneuron_fallback_mode = "warn"


@dataclass(frozen=True)
class TorchNeuronBackend(Backend):
    """TorchNeuron (`torch_neuronx`): the `neuron` device of a Trn instance."""

    name: ClassVar[str] = "torchneuron"
    compiles_itself: ClassVar[bool] = True
    applies_policy_per_op: ClassVar[bool] = False
    detected_by_transformers: ClassVar[bool] = True
    collective_transport: ClassVar[str] = "TorchNeuron's collectives"
    sets_defaults_at_import: ClassVar[bool] = True
    counts_transfers: ClassVar[bool] = False

    @property
    def profile(self) -> str:
        return "hardware"

    @property
    def neff_cache(self) -> Path:
        return neff_cache_dir()

    def op_tracker(self) -> ModuleType:
        return importlib.import_module("torch_neuronx")  # (its op tracking is on its top-level module)

    def fallback_mode(self) -> str:
        return _torchneuron_fallback_mode

    def _set_fallback_mode(self, mode: str) -> None:
        global _torchneuron_fallback_mode
        _torchneuron_fallback_mode = mode

    # (Printing the backend must not start TorchNeuron's runtime: no device memory in `__str__`.)


@dataclass(frozen=True)
class ReferenceBackend(Backend):
    """The library's reference `neuron` device (host memory), used where TorchNeuron is absent."""

    name: ClassVar[str] = "reference"
    compiles_itself: ClassVar[bool] = False
    applies_policy_per_op: ClassVar[bool] = True
    detected_by_transformers: ClassVar[bool] = False
    collective_transport: ClassVar[str] = "gloo over host views"
    sets_defaults_at_import: ClassVar[bool] = False
    counts_transfers: ClassVar[bool] = True

    @property
    def profile(self) -> str:
        from . import reference

        return reference.state().profile.name

    def op_tracker(self) -> Any:
        from . import reference

        return reference.op_tracker()

    def fallback_counts(self) -> dict[str, tuple[int | None, float | None]]:
        from . import reference

        return dict(reference.fallback_counts())

    def fallback_mode(self) -> str:
        from . import reference

        return reference.fallback_mode()

    def _set_fallback_mode(self, mode: str) -> None:
        from . import reference

        reference.set_fallback_mode(mode)  # (the device applies it to every op call)

    @contextlib.contextmanager
    def support_profile(self, name: str) -> Iterator[None]:
        from . import reference

        previous = reference.state().profile
        reference.set_profile(name)
        try:
            yield
        finally:
            reference.set_profile(previous)

    def _memory_text(self) -> str:
        return f" of {self.device_memory / 2**30:.1f} GiB"
