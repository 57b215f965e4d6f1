"""How generation compiles its graphs: the compile settings, the logging calls traced as nothing, and
the functions that get compiled (a module's call, a step of generation)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import CompileConfig

from .interval_masks import in_graph
from .sampling import sample

COMPILE_CONFIG = CompileConfig(backend="neuron", fullgraph=True, dynamic=False, mode="default")
# Logging calls Dynamo traces as no-ops in the compiled forward (they still log when run eagerly).
# `warning_once` and `info_once` are the methods Transformers adds to `logging.Logger`.
QUIET_WHILE_TRACED = {getattr(logging.Logger, name)
                      for name in ("debug", "info", "warning", "warning_once", "info_once")
                      if hasattr(logging.Logger, name)}


def call_module(module: torch.nn.Module, **inputs: Any) -> Any:
    """What gets compiled: a call of the module, which it takes as an argument so that the compiled
    function holds no reference to the model (the model holds it)."""
    return module(**inputs)


def image_features(model: torch.nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """What gets compiled for the images of a vision-language model: their features, `[images,
    tokens, hidden]` (its `get_image_features`: the vision tower and the projector)."""
    features = model.get_image_features(pixel_values=pixel_values, return_dict=True).pooler_output
    return torch.stack(list(features)) if isinstance(features, (list, tuple)) else features


def generation_step(model: torch.nn.Module, sampling: tuple[torch.Tensor, torch.Tensor] | None = None,
                    **inputs: Any) -> tuple[Any, torch.Tensor]:
    """What gets compiled for a step of generation (its masks as intervals, see `interval_masks`):
    the model's output, and the token of each row, chosen on the device: drawn with `sampling` (the
    parameters and uniform numbers, see `sampling.sample`) when given, else the greedy token (the
    last position's logits, first of equal maxima, as `torch.argmax` on the host chooses)."""
    if "attention_mask" in inputs:
        inputs["attention_mask"] = in_graph(inputs["attention_mask"])
    output = model(**inputs)
    if sampling is not None:
        return output, sample(output.logits[:, -1], *sampling)
    return output, output.logits[:, -1].argmax(-1)


def dense(value: Any) -> Any:
    """`value` with the strides of a new contiguous tensor (Dynamo guards on strides, even those
    of size-1 dimensions that `contiguous()` leaves as they are)."""
    if not isinstance(value, torch.Tensor):
        return value
    expected, stride = [], 1
    for size in reversed(value.shape):
        expected.append(stride)
        stride *= max(size, 1)
    if value.stride() != tuple(reversed(expected)):
        return value.clone(memory_format=torch.contiguous_format)
    return value
