"""`sorted_topk`: `topk(..., sorted=False)` computed as `sorted=True`, which Torch-MLIR can lower.

`sorted=False` leaves the order of the k results unspecified, so the sorted order is one of its
valid results: the same k values and indices, in descending order. Torch-MLIR fails to legalize the
unsorted form to StableHLO, which DeepSeek-style MoE routers use to pick expert groups and experts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .registry import ModelPatch, Undo, code_reached, forwards_under_mode

_TOPK = (torch.topk, torch.Tensor.topk)
_SORTED_POSITION = 4  # topk(input, k, dim, largest, sorted)


class _SortedTopk(TorchFunctionMode):
    """Runs `torch.topk` and `Tensor.topk` with `sorted=True` wherever `sorted=False` was asked."""

    def __torch_function__(self, func, tensor_types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _TOPK:
            if kwargs.get("sorted") is False:
                kwargs["sorted"] = True
            elif len(args) > _SORTED_POSITION and args[_SORTED_POSITION] is False:
                args = (*args[:_SORTED_POSITION], True, *args[_SORTED_POSITION + 1:])
        return func(*args, **kwargs)


def _calls_unsorted_topk(cls: type) -> bool:
    """Whether the class's code calls `topk` with a `sorted` argument set to the constant False."""
    return any(
        "topk" in code.co_names and False in code.co_consts
        and any(isinstance(constant, tuple) and "sorted" in constant for constant in code.co_consts)
        for code in code_reached(cls)
    )


def _unsorted_topk_modules(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if _calls_unsorted_topk(type(module))]


def _sort_topk(model: nn.Module) -> Undo:
    return forwards_under_mode(_unsorted_topk_modules(model), _SortedTopk)


PATCH = ModelPatch(
    name="sorted_topk",
    description="topk(sorted=False) runs as topk(sorted=True), one of its valid results, which Torch-MLIR lowers to "
                "StableHLO (it cannot legalize the unsorted form, used by DeepSeek-style MoE routers).",
    architectures=("deepseek_v3", "glm4_moe", "glm4_moe_lite", "exaone_moe", "kimi_linear", "minimax_m2", "nemotron_h",
                   "solar_open", "hy_v3"),
    applies=lambda model: bool(_unsorted_topk_modules(model)),
    apply=_sort_topk,
)
