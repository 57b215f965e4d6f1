"""Scoped, reversible model patches: rewrites of constructs TorchNeuron cannot run (complex tensors,
data-dependent shapes, float64, sparse tensors) into equivalents it can, applied to one model instance.

A patch never touches a Transformers class or function: it replaces a module's `forward` on the
instance (with Transformers' own implementation where one exists) or flips an attribute on the
instance. Each `apply` returns its undo; `model.neuron_patches` lists what a model carries.

`registry` holds `ModelPatch`, the registry and the apply/revert machinery; each other module
defines one patch (its `PATCH`), registered below when this package is imported, in the order in
which `apply_patches` applies them.
"""

from . import (
    complex_rope,
    dense_embeddings,
    float64_to_float32,
    rope_on_device,
    sorted_topk,
    static_moe_experts,
    unit_triangular_solve,
)
from .registry import PATCHES, ModelPatch, apply_patches, patched, patches_for, register_patch, revert_patches

for _module in (complex_rope, static_moe_experts, sorted_topk, unit_triangular_solve, rope_on_device,
                float64_to_float32, dense_embeddings):
    register_patch(_module.PATCH)
del _module

__all__ = [
    "ModelPatch",
    "PATCHES",
    "apply_patches",
    "patched",
    "patches_for",
    "register_patch",
    "revert_patches",
]
