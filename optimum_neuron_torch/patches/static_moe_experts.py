"""`static_moe_experts`: MoE experts run Transformers' static `batched_mm` implementation instead of
routing with data-dependent shapes, as TorchNeuron needs static shapes."""

from __future__ import annotations

import copy
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
    config's switch is left alone: models built from one config object share it). An experts
    module whose forward is already wrapped on the instance (tensor parallelism's hooks, which
    call the class's forward inside) keeps its wrapper and gets a config of its own instead, set
    to the static implementation, which the class's forward dispatches on."""
    static_forward = moe.ALL_EXPERTS_FUNCTIONS[STATIC_EXPERTS]
    undos = []
    for module in _switchable_experts(model):
        if "forward" in module.__dict__:
            undos.append(_own_config(module))
        else:
            undos.append(replace_forward(module, types.MethodType(static_forward, module)))
    return undo_all(undos)


def _own_config(module: nn.Module) -> Undo:
    shared = module.config
    module.config = copy.copy(shared)
    module.config._experts_implementation = STATIC_EXPERTS

    def undo() -> None:
        module.config = shared

    return undo


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
