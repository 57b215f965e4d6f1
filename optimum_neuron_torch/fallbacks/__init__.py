"""Keeping unsupported ops working: the fallback policy and scoped model patches."""

from .generation_ops import native_generation_ops
from .patches import (
    PATCHES,
    ModelPatch,
    apply_patches,
    patched,
    patches_for,
    register_patch,
    revert_patches,
)
from .policy import FallbackStats, fallback_policy, fallback_stats, get_fallback_policy, set_fallback_policy

__all__ = [
    "FallbackStats",
    "ModelPatch",
    "PATCHES",
    "apply_patches",
    "fallback_policy",
    "fallback_stats",
    "get_fallback_policy",
    "native_generation_ops",
    "patched",
    "patches_for",
    "register_patch",
    "revert_patches",
    "set_fallback_policy",
]
