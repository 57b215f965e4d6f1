"""The `neuron` torch.compile backend (Inductor C++ code generation on the reference device).

Registered through the `torch_dynamo_backends` entry point, as TorchNeuron registers its own:
`torch.compile(model, backend="neuron")` finds it without an import.
"""

from .backend import NAME, neuron_backend

__all__ = ["NAME", "neuron_backend"]
