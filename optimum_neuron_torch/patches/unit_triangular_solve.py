"""`unit_triangular_solve`: `torch.linalg.solve_triangular(L, B, upper=False, unitriangular=True)`
computed with matrix products, which TorchNeuron's compiler takes (Torch-MLIR has no lowering for
the triangular solve that gated-delta-rule linear attention uses on each chunk).

With L = I + N, N strictly lower triangular (so N^n = 0 for n x n matrices), the inverse is the
finite series I - N + N^2 - ... = (I + M)(I + M^2)(I + M^4)... with M = -N, ceil(log2 n) factors:
the same solution in 2 ceil(log2 n) matrix products (12 for a chunk of 64), exact up to rounding.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .registry import ModelPatch, Undo, forwards_under_mode, names_used


def solve_unit_lower_triangular(matrix: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """X with L X = rhs, L the unit lower triangle of `matrix` (its diagonal and upper part unread)."""
    size = matrix.shape[-1]
    steps = math.ceil(math.log2(size)) if size > 1 else 0
    power = -matrix.tril(-1)  # M, then M^2, M^4, ...
    solution = rhs
    for step in range(steps):
        solution = solution + power @ solution  # (I + M^(2^step)) applied
        if step + 1 < steps:
            power = power @ power
    return solution


class _UnitTriangularSolveByProducts(TorchFunctionMode):
    """Runs unit lower-triangular solves as `solve_unit_lower_triangular`; other calls unchanged."""

    def __torch_function__(self, func, tensor_types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.linalg.solve_triangular and len(args) == 2 and kwargs.get("upper") is False
                and kwargs.get("unitriangular") is True and kwargs.get("left", True) and "out" not in kwargs):
            return solve_unit_lower_triangular(*args)
        return func(*args, **kwargs)


def _solving_modules(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if "solve_triangular" in names_used(type(module))]


def _solve_by_products(model: nn.Module) -> Undo:
    return forwards_under_mode(_solving_modules(model), _UnitTriangularSolveByProducts)


PATCH = ModelPatch(
    name="unit_triangular_solve",
    description="Unit lower-triangular solves (gated delta rule linear attention) are computed with matrix products "
                "(the inverse's finite series), which TorchNeuron compiles; Torch-MLIR cannot lower the solve.",
    architectures=("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini"),
    applies=lambda model: bool(_solving_modules(model)),
    apply=_solve_by_products,
)
