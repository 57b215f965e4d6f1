"""`static_moe_experts`: MoE experts run Transformers' static `batched_mm` implementation instead of
routing with data-dependent shapes, as TorchNeuron needs static shapes."""

from __future__ import annotations

import types
from collections.abc import Callable

from torch import nn
from transformers.integrations import moe

from .registry import ModelPatch, Undo, replace_forward, undo_all

STATIC_EXPERTS = "batched_mm"


def _switchable_experts(model: nn.Module) -> list[nn.Module]:
    """Expert modules whose forward Transformers dispatches on `config._experts_implementation`."""
    return [module for module in model.modules() if _defined_in(type(module).forward, moe.__file__)]


def _defined_in(function: Callable, filename: str) -> bool:
    """Whether `function`'s own code (not what it wraps) comes from `filename`."""
    code = getattr(function, "__code__", None)
    return code is not None and code.co_filename == filename


def _use_static_experts(model: nn.Module) -> Undo:
    """Binds Transformers' own static implementation to each experts module of this instance (the
    config's switch is left alone: models built from one config object share it)."""
    static_forward = moe.ALL_EXPERTS_FUNCTIONS[STATIC_EXPERTS]
    return undo_all([
        replace_forward(module, types.MethodType(static_forward, module)) for module in _switchable_experts(model)
    ])


PATCH = ModelPatch(
    name="static_moe_experts",
    description=f"MoE experts run Transformers' {STATIC_EXPERTS!r} experts implementation (each token through "
                "its top-k experts as one gather + bmm) instead of the nonzero/where routing loop or grouped_mm: "
                "TorchNeuron needs static shapes.",
    # The detector finds every experts module built with Transformers' @use_experts_implementation (67 model
    # types in Transformers 5.24); these are the best known.
    architectures=("mixtral", "phimoe", "qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "granitemoe", "deepseek_v2",
                   "deepseek_v3", "glm4_moe", "minimax", "gpt_oss"),
    applies=lambda model: bool(_switchable_experts(model)),
    apply=_use_static_experts,
)
