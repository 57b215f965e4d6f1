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
