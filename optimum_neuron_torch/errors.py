"""Every error optimum-neuron-torch raises on purpose: each names what is at fault and what to do.

All derive from `NeuronTorchError` and from the builtin error of the same kind, so that `except
NeuronTorchError` catches everything the library refuses, while `except ValueError` (or
`FileNotFoundError`, `ImportError`, `RuntimeError`, `TypeError`, `torch.OutOfMemoryError`) keeps
catching what it caught before each error got its own class.

Two refusals keep the builtin type of the layer they mirror: the functions of `torch.neuron`
raise what TorchNeuron's raise, and an op refused by the `error` fallback policy raises
`NotImplementedError`, as PyTorch does for an op without a kernel (on the reference device it comes
from the C++ dispatcher, which cannot raise a Python subclass).

    NeuronTorchError
    ├── ConfigurationError (ValueError)             a setting or argument with a value the library cannot use
    ├── ArgumentTypeError (TypeError)               an argument of a type the function does not take
    ├── BackendUnavailableError (RuntimeError)      the `neuron` backend asked for cannot be activated
    │   ├── BackendConflictError                    another library owns PyTorch's PrivateUse1 slot
    │   └── ReferenceDeviceBuildError               the reference device's C++ extension did not build
    ├── CheckpointError (ValueError)                a checkpoint that cannot be loaded (file and tensor named)
    │   ├── CheckpointNotFoundError (FileNotFoundError)
    │   └── UnsafeCheckpointError                   pickled weights, not allowed
    ├── UnsupportedModelError (ValueError)          no model of this Auto class for the checkpoint's config
    ├── MissingDependencyError (ImportError)        an optional package the call needs is not installed
    ├── InsufficientDeviceMemoryError (torch.OutOfMemoryError)
    ├── UnsupportedGraphError (RuntimeError)        a graph TorchNeuron's compiler cannot take
    ├── LoweringError (RuntimeError)                a graph that does not lower to StableHLO
    ├── CompileCacheError (RuntimeError)            a compiled-graph entry or a cache remote that cannot be used
    ├── CollectiveArgumentError (ValueError)        a collective given tensors it cannot take (names them)
    ├── CollectiveError (torch.distributed.DistBackendError)
    │                                               a collective that failed: a peer exited or timed out
    ├── RankFailedError (RuntimeError)              another rank of the job failed a step all ranks take
    ├── InvalidRequestError (ValueError)            a served request with a field the server cannot take (names it)
    └── ServerBusyError (RuntimeError)              a server whose request queue is full, or not serving

One exception here is not a refusal and never reaches the user: `UncacheableGraph` (an `Exception`,
outside the tree), which the compiler raises and catches itself to run a graph it cannot cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed


def first_line(error: BaseException | str) -> str:
    """The first line of an error's message (empty when it has none), for messages that quote another."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


class NeuronTorchError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigurationError(NeuronTorchError, ValueError):
    """An environment variable or argument has a value this library cannot use."""


class ArgumentTypeError(NeuronTorchError, TypeError):
    """An argument of a type the function does not take, or a keyword argument it does not know."""


class BackendUnavailableError(NeuronTorchError, RuntimeError):
    """The `neuron` backend that was asked for (or any backend) cannot be activated."""


class BackendConflictError(BackendUnavailableError):
    """Another library already owns PyTorch's PrivateUse1 device slot."""


class ReferenceDeviceBuildError(BackendUnavailableError):
    """The reference device's C++ extension could not be built or loaded."""


class CheckpointError(NeuronTorchError, ValueError):
    """A checkpoint cannot be loaded: names the file (and tensor) at fault and what to do."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        where = ", ".join(part for part in (file and f"file {file}", tensor and f"tensor {tensor!r}") if part)
        super().__init__(f"{where}: {message}" if where else message)
        self.file = file
        self.tensor = tensor


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint, or a file it names, does not exist."""


class UnsafeCheckpointError(CheckpointError):
    """The checkpoint is pickled (`pytorch_model.bin`) and pickled weights were not allowed."""


class UnsupportedModelError(NeuronTorchError, ValueError):
    """The Auto class has no model for the checkpoint's configuration."""


class MissingDependencyError(NeuronTorchError, ImportError):
    """An optional package the call needs is not installed; the message says which and how to get it."""


class InsufficientDeviceMemoryError(NeuronTorchError, torch.OutOfMemoryError):
    """The model does not fit in the device's free memory; raised before anything is loaded."""


class UnsupportedGraphError(NeuronTorchError, RuntimeError):
    """A graph TorchNeuron's compiler cannot take (dynamic shapes; ops it cannot lower while graph
    splitting is disabled)."""


class LoweringError(NeuronTorchError, RuntimeError):
    """A graph does not lower to StableHLO, so TorchNeuron's compiler could not take it; the
    message is Torch-MLIR's first diagnostic."""


class CompileCacheError(NeuronTorchError, RuntimeError):
    """A compiled graph that cannot be used (its files do not match their checksums), or a cache
    remote that cannot be read or written (`cache push` / `cache pull`): the message names the
    entry or the destination."""


class CollectiveArgumentError(NeuronTorchError, ValueError):
    """A collective of the `neuron` process group was given tensors it cannot take: on the CPU or on
    several devices, or of sizes that do not fit the collective (the message names the tensor)."""


class CollectiveError(NeuronTorchError, torch.distributed.DistBackendError):
    """A collective of the `neuron` process group failed: a peer exited, or the group's timeout passed.

    Attributes:
        rank: the rank that raised it (in its group).
        failed_ranks: the group's ranks whose process had exited when the failure was seen (empty
            when none had: a peer stuck, or on another host).
    """

    def __init__(self, message: str, *, rank: int, failed_ranks: list[int]):
        super().__init__(message)
        self.rank = rank
        self.failed_ranks = failed_ranks


class RankFailedError(NeuronTorchError, RuntimeError):
    """Another rank of the job failed a step every rank takes together (e.g. loading its pieces of
    a tensor-parallel model); the message names the rank and its error."""


# The device's or the job's state, not one call's input (device memory exhausted, a rank of the job gone):
# generation raises them rather than retrying eagerly, and the serving engine stops on them rather than
# failing only the requests at hand, since the next call would meet them too.
DEVICE_OR_JOB_FAILURES = (torch.OutOfMemoryError, InsufficientDeviceMemoryError, RankFailedError, CollectiveError)


class InvalidRequestError(NeuronTorchError, ValueError):
    """A request to the server with a field it cannot take: `param` names the field (as the
    OpenAI API's error body does), the message says why and what would do."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(InvalidRequestError):
    """A request naming a model (or adapter) the server does not serve (404, as the OpenAI API
    answers it: `model_not_found`)."""

    def __init__(self, message: str, param: str = "model") -> None:
        super().__init__(message, param)


class ServerBusyError(NeuronTorchError, RuntimeError):
    """The server takes no request now: its queue is full (429; `retry_after` seconds is a fair wait),
    it is `starting` (503; the server says when to retry), or stopping or failed (503)."""

    def __init__(self, message: str, retry_after: int | None = None, *, starting: bool = False) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.starting = starting


class UncacheableGraph(Exception):
    """Raised by `compile_into` for a graph that compiled but that AOTAutograd would not make
    serializable (it bypasses its cache for, e.g., autocast inside activation checkpointing): it
    carries the compiled graph, which runs in this process only."""

    def __init__(self, compiled: Callable[..., Any], reason: str) -> None:
        super().__init__(reason)
        self.compiled = compiled
