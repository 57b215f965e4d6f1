"""Activation checkpointing that compiles on `neuron`: random ops are saved, not recomputed.

Under `torch.compile`, a checkpointed region's random ops (dropout, and the fused attention op,
which PyTorch tags as random because it can drop out) are recomputed in the backward pass through
RNG-state operators (`run_and_save_rng_state`) that PyTorch implements for CPU, CUDA, XPU and HPU
only: any PrivateUse1 device, TorchNeuron included, fails to compile. Saving those ops' outputs
instead (PyTorch's selective activation checkpointing) keeps the backward exact, costs the memory of
the attention outputs and dropout masks, and lets the graph compile and be cached.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def _save_random_ops(ctx: Any, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if torch.Tag.nondeterministic_seeded in op.tags:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


SAVE_RANDOM_OPS = functools.partial(create_selective_checkpoint_contexts, _save_random_ops)
# Lets AOTAutograd (and so the persistent compile cache) cache graphs that use this policy.
SAVE_RANDOM_OPS.cache_hash = "optimum_neuron_torch.training.activation_checkpointing.SAVE_RANDOM_OPS/1"


def with_random_ops_saved(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`torch.utils.checkpoint` keyword arguments with the random-op policy added, unless the caller
    chose reentrant checkpointing (which takes no policy) or a policy of their own."""
    kwargs = dict(kwargs or {})
    if kwargs.get("use_reentrant", False) or "context_fn" in kwargs:
        return kwargs
    return {**kwargs, "use_reentrant": False, "context_fn": SAVE_RANDOM_OPS}


def save_random_ops_when_checkpointing(model: torch.nn.Module) -> None:
    """Makes `model.activation_checkpointing_enable` (which `Trainer`, peft and the deprecated
    `gradient_checkpointing_enable` call) use the random-op policy. Set on the instance only;
    `del model.activation_checkpointing_enable` undoes it."""
    enable = getattr(type(model), "activation_checkpointing_enable", None)
    if enable is None or "activation_checkpointing_enable" in vars(model):
        return
    # A plain function holding the model weakly: a bound method in the model's own dict would be a
    # reference cycle, and the model's device memory would wait for the garbage collector.
    owner = weakref.ref(model)

    def activation_checkpointing_enable(activation_checkpointing_kwargs=None, *args, **kwargs):
        return enable(owner(), with_random_ops_saved(activation_checkpointing_kwargs), *args, **kwargs)

    model.activation_checkpointing_enable = activation_checkpointing_enable
