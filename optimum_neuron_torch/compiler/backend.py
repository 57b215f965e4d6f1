"""The `neuron` torch.compile backend.

On TorchNeuron, TorchNeuron's own backend compiles (Torch-MLIR -> StableHLO -> NEFF). On the
reference device, Dynamo's graph goes through AOTAutograd to Inductor's C++ code generation on
`neuron` tensors. Like TorchNeuron, it accepts static shapes only, and compiles every `mode` as
the default one.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch

from ..device import backend_info

logger = logging.getLogger(__name__)

NAME = "neuron"
DYNAMIC_SHAPES_MESSAGE = "Dynamic shapes detected in the model, but torch-neuronx requires static shapes"


def _has_symbolic_shapes(example_inputs: list[Any]) -> bool:
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            return True
        if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride())):
            return True
    return False


def neuron_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
    """Compiles a Dynamo graph for the `neuron` device."""
    if backend_info().name == "torchneuron":
        from torch_neuronx.neuron_dynamo_backend import backend as torchneuron_backend

        return torchneuron_backend.neuron_backend(gm, example_inputs, **kwargs)
    mode = kwargs.pop("mode", None)
    if mode not in (None, "default"):
        warnings.warn(f"torch.compile mode {mode!r} is not supported by the neuron backend; compiling as 'default'.", stacklevel=2)
    if _has_symbolic_shapes(example_inputs):
        raise RuntimeError(
            f"{DYNAMIC_SHAPES_MESSAGE}. Compile with torch.compile(..., dynamic=False): every new input shape is "
            "then a new (cached) compile, as on Trainium."
        )
    from torch._inductor.compile_fx import compile_fx

    from .inductor_device import host_memory_codegen, register

    register()
    with host_memory_codegen():
        return compile_fx(gm, example_inputs, config_patches=kwargs.pop("options", None))
