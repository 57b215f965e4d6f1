"""`float64_to_float32`: float64 requested inside a module's forward is computed in float32, as
TorchNeuron has no float64 (those values then carry float32 precision)."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from .registry import ModelPatch, Undo, forwards_under_mode, names_used


class _Float64AsFloat32(TorchFunctionMode):
    """Runs torch functions with every float64 dtype argument, and `Tensor.double`, made float32."""

    def __torch_function__(self, func, tensor_types, args=(), kwargs=None):
        if func is torch.Tensor.double:
            func = torch.Tensor.float
        args, kwargs = tree_map(lambda value: torch.float32 if value is torch.float64 else value, (args, kwargs or {}))
        return func(*args, **kwargs)


def _float64_modules(model: nn.Module) -> list[nn.Module]:
    """Modules whose forward (or what it calls in its modeling module) names float64."""
    return [module for module in model.modules() if {"float64", "double"} & names_used(type(module))]


def _narrow_float64(model: nn.Module) -> Undo:
    modules = _float64_modules(model)
    warnings.warn(
        f"{type(model).__name__}: float64 in {', '.join(sorted({type(m).__name__ for m in modules}))} is computed "
        "in float32 (TorchNeuron has no float64): results agree to float32 precision.",
        stacklevel=3,
    )
    return forwards_under_mode(modules, _Float64AsFloat32)


PATCH = ModelPatch(
    name="float64_to_float32",
    description="float64 dtypes requested inside a module's forward become float32 (TorchNeuron has no float64); "
                "note: those values then carry float32 precision.",
    architectures=("aimv2", "rt_detr", "rt_detr_v2", "d_fine", "deimv2", "pp_doclayout_v2", "pp_doclayout_v3",
                   "pp_doclayout_v4", "musicflamingo", "udop"),
    applies=lambda model: bool(_float64_modules(model)),
    apply=_narrow_float64,
)
