"""Errors raised by optimum-neuron-torch: each names what is at fault and what to do."""

from __future__ import annotations


class NeuronTorchError(Exception):
    """Base class of every error this library raises on purpose."""


class BackendUnavailableError(NeuronTorchError):
    """The `neuron` backend that was asked for (or any backend) cannot be activated."""


class BackendConflictError(BackendUnavailableError):
    """Another library already owns PyTorch's PrivateUse1 device slot."""


class ReferenceDeviceBuildError(BackendUnavailableError):
    """The reference device's C++ extension could not be built or loaded."""


class ConfigurationError(NeuronTorchError, ValueError):
    """An environment variable or argument has a value this library cannot use."""


class CheckpointError(NeuronTorchError):
    """A checkpoint cannot be loaded: names the file (and tensor) at fault and what to do."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        where = ", ".join(part for part in (file and f"file {file}", tensor and f"tensor {tensor!r}") if part)
        super().__init__(f"{where}: {message}" if where else message)
        self.file = file
        self.tensor = tensor


class UnsafeCheckpointError(CheckpointError):
    """The checkpoint is pickled (`pytorch_model.bin`) and pickled weights were not allowed."""


class InsufficientDeviceMemoryError(NeuronTorchError):
    """The model does not fit in the device's free memory; raised before anything is loaded."""
