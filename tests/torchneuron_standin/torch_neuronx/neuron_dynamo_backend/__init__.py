"""TorchNeuron's torch.compile backend (`backend="neuron"`), simulated.

The backend itself is `torch_neuronx.neuron_dynamo_backend.backend:neuron_backend`, found by torch through
the `torch_dynamo_backends` entry point; it is imported when first used (it imports torch._dynamo).
Importing this package registers the `neuron_neff` MegaCache artifact type, as TorchNeuron's does at
`import torch`, so that `torch.compiler.load_cache_artifacts` works before anything is compiled.
"""

from torch_neuronx.neuron_dynamo_backend import cache_artifact as _cache_artifact  # noqa: F401
from torch_neuronx.neuron_dynamo_backend.metrics import (
    get_dynamo_metrics,
    reset_dynamo_metrics,
)

__all__ = ["get_dynamo_metrics", "reset_dynamo_metrics"]
