"""The `neuron` torch.compile backend (Inductor C++ code generation on the reference device) and
the persistent cache of compiled graphs; graphs holding nodes TorchNeuron's compiler cannot take
are split around them; `regions` compiles each distinct repeated layer of a graph once.

`import optimum_neuron_torch` registers it under the name `neuron` when the reference device is
active (TorchNeuron registers its own), so `torch.compile(model, backend="neuron")` runs unchanged
on both.
"""

from .cache import CompileCache, cache_stats, reset_cache_stats
from .dynamo_backend import NAME, neuron_backend
from .partition import (
    FallbackNode,
    PartitionReport,
    recording_partitions,
)

__all__ = [
    "NAME", "CompileCache", "FallbackNode", "PartitionReport", "cache_stats", "neuron_backend", "recording_partitions",
    "reset_cache_stats",
]
