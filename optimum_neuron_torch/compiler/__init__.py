"""The `neuron` torch.compile backend (Inductor C++ code generation on the reference device) and
the persistent cache of compiled graphs; graphs holding nodes TorchNeuron's compiler cannot take
are split around them.

Registered through the `torch_dynamo_backends` entry point, as TorchNeuron registers its own:
`torch.compile(model, backend="neuron")` finds it without an import.
"""

from .backend import NAME, neuron_backend
from .cache import CompileCache, cache_root, cache_stats, reset_cache_stats
from .partition import (
    DISABLE_SPLIT_ENV,
    FallbackNode,
    PartitionReport,
    UnsupportedGraphError,
    recording_partitions,
)

__all__ = [
    "DISABLE_SPLIT_ENV", "NAME", "CompileCache", "FallbackNode", "PartitionReport", "UnsupportedGraphError",
    "cache_root", "cache_stats", "neuron_backend", "recording_partitions", "reset_cache_stats",
]
