"""The `neuron` torch.compile backend (Inductor C++ code generation on the reference device) and
the persistent cache of compiled graphs.

Registered through the `torch_dynamo_backends` entry point, as TorchNeuron registers its own:
`torch.compile(model, backend="neuron")` finds it without an import.
"""

from .backend import NAME, neuron_backend
from .cache import CompileCache, cache_root, cache_stats, reset_cache_stats

__all__ = ["NAME", "CompileCache", "cache_root", "cache_stats", "neuron_backend", "reset_cache_stats"]
