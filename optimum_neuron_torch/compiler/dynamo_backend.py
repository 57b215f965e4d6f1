"""The `neuron` torch.compile backend of the reference device.

On TorchNeuron, `backend="neuron"` is TorchNeuron's own backend (Torch-MLIR -> StableHLO -> NEFF,
found through its `torch_dynamo_backends` entry point) and its NEFF cache is in charge: this module
is not registered. On the reference device, `register()` (called when the device is activated)
makes this backend the `neuron` one, and Dynamo's graph goes through AOTAutograd to
Inductor's C++ code generation on `neuron` tensors, and the result is kept in the persistent
compile cache: a graph compiled once, by any process, is loaded rather than compiled again. Like
TorchNeuron, it accepts static shapes only, compiles every `mode` as the default one, and refuses
a graph holding nodes TorchNeuron's compiler cannot take (it does not split it: the library's own
compiled paths do, on both backends, see `partition.compile_or_split`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import LoweringError, UncacheableGraph, UnsupportedGraphError, first_line
from . import artifact, partition
from .cache import STATS, CompileCache, graph_key

logger = logging.getLogger(__name__)

NAME = "neuron"
DYNAMIC_SHAPES_MESSAGE = "Dynamic shapes detected in the model, but torch-neuronx requires static shapes"


def _has_symbolic_shapes(example_inputs: list[Any]) -> bool:
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            return True
        if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt)
                                                   for s in (*value.shape, *value.stride())):
            return True
    return False


def neuron_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
    """Compiles a Dynamo graph for the reference `neuron` device."""
    mode = kwargs.pop("mode", None)
    if mode not in (None, "default"):
        warnings.warn(f"torch.compile mode {mode!r} is not supported by the neuron backend; compiling as 'default'.",
                      stacklevel=2)
    if _has_symbolic_shapes(example_inputs):
        raise UnsupportedGraphError(
            f"{DYNAMIC_SHAPES_MESSAGE}. Compile with torch.compile(..., dynamic=False): every new input shape is "
            "then a new (cached) compile, as on Trainium."
        )
    return _compile(gm, example_inputs, kwargs.pop("options", None) or {})


def register() -> None:
    """Makes this backend `torch.compile(backend="neuron")`. Registered in Dynamo's own registry at
    activation rather than declared as an entry point: TorchNeuron declares `neuron` in that group,
    and torch keeps whichever entry point it finds first."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if _COMPILER_FNS.get(NAME) is not neuron_backend:
        register_backend(neuron_backend, name=NAME)


def _compile(gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict[str, Any]) -> Callable[..., Any]:
    """The graph compiled whole, or refused as TorchNeuron's backend refuses it: TorchNeuron compiles
    a graph whole or fails (`neuron_dynamo_backend/backend.py`), it never splits one. Refused: a
    graph holding nodes TorchNeuron's compiler cannot take by construction, or (with torch-mlir)
    nodes that do not lower alone. A graph that does not lower although each of its nodes does (no
    culprit to name: Torch-MLIR's release may differ from TorchNeuron's there) is compiled with the
    lowering warning. The library's own compiled paths split refused graphs (`partition.compile_or_split`).

    Raises:
        UnsupportedGraphError: the graph holds nodes TorchNeuron's compiler cannot take (named).
    """
    unsupported = partition.unsupported_by_construction(gm)
    lowering_failure = None
    if not unsupported:
        try:
            return compile_cached(gm, example_inputs, options, strict_lowering=True)
        except LoweringError as error:
            unsupported, lowering_failure = partition.failing_to_lower(gm), str(error)
    if unsupported:
        raise partition.refusal(unsupported)
    return compile_cached(gm, example_inputs, options, lowering_failure=lowering_failure)


_recorders: list[set[str]] = []


@contextlib.contextmanager
def recording_cache_keys() -> Iterator[set[str]]:
    """Collects the cache keys of the graphs compiled, loaded or run inside the block."""
    keys: set[str] = set()
    _recorders.append(keys)
    try:
        yield keys
    finally:  # (this block's own set: an enclosing block's may hold the same keys, and `remove` compares by value)
        del _recorders[next(index for index, recorder in enumerate(_recorders) if recorder is keys)]


def compile_cached(gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict[str, Any],
                   *, strict_lowering: bool = False, lowering_failure: str | None = None) -> Callable[..., Any]:
    """The compiled graph from the cache, compiled and stored first when it is not there. With
    `strict_lowering`, a graph known (or found) not to lower to StableHLO raises `LoweringError`;
    `lowering_failure` is how the graph already failed to lower, if it did (see `compile_into`)."""
    environment = artifact.compile_environment()
    key = graph_key(gm, example_inputs, environment, options)
    inputs = [list(value.shape) for value in example_inputs if isinstance(value, torch.Tensor)]

    def build(folder):
        logger.info("Compiling a graph for the neuron device (cache key %s)", key[:16])
        compiled = artifact.compile_into(gm, example_inputs, folder, options, strict_lowering=strict_lowering,
                                         lowering_failure=lowering_failure)
        return {"environment": environment, "input_shapes": inputs, **compiled}

    start = time.perf_counter()
    cache = CompileCache()
    try:
        entry, built = cache.get_or_build(key, build)
    except UncacheableGraph as uncacheable:
        STATS.misses += 1
        STATS.uncached += 1
        STATS.compile_seconds += time.perf_counter() - start
        warnings.warn(f"A graph compiled for the neuron device cannot be stored in the compile cache "
                      f"({uncacheable}; PyTorch's AOTAutograd does not serialize graphs with, e.g., autocast "
                      "inside activation checkpointing): it is compiled again in each process.", stacklevel=2)
        return _recorded(uncacheable.compiled, key)
    if built:  # (counted before a strict check refuses it: the compile happened)
        STATS.misses += 1
        STATS.compile_seconds += time.perf_counter() - start
    if strict_lowering and artifact.lowering_failed(entry.metadata.get("stablehlo", artifact.LOWERS)):
        raise LoweringError(entry.metadata["stablehlo"])
    try:
        compiled = artifact.load(entry.path)
    except Exception as error:  # an entry that matches its checksums but does not load is never used
        if built:
            raise
        cache.discard(key, f"it does not load ({type(error).__name__}: {first_line(error)})")
        return compile_cached(gm, example_inputs, options, strict_lowering=strict_lowering,
                              lowering_failure=lowering_failure)
    if not built:
        STATS.hits += 1
        STATS.load_seconds += time.perf_counter() - start
    return _recorded(compiled, key)


def note_cache_key(key: str) -> None:
    """Notes `key`, the cache entry of something about to run, in the active recorders."""
    for keys in _recorders:
        keys.add(key)


def _recorded(compiled: Callable[..., Any], key: str) -> Callable[..., Any]:
    """`compiled`, noting `key` in the active recorders now and on every call: Dynamo runs a graph
    compiled for an earlier model of the same shapes again without asking the backend."""
    note_cache_key(key)

    def run(*args: Any) -> Any:
        note_cache_key(key)
        return compiled(*args)

    return run
