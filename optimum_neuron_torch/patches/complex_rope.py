"""`complex_rope`: complex rotary embeddings (`torch.polar`, `view_as_complex`) computed in real
cos/sin arithmetic, as TorchNeuron has no complex dtypes."""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_rope_utils import dynamic_rope_update

from .registry import ModelPatch, Undo, names_used, replace_forward, undo_all, with_globals

# Modeling modules whose text RoPE is complex (the rotary module returns `torch.polar(1, angles)`,
# `apply_rotary_emb` multiplies `view_as_complex(q, k)` by it), with the axis at which their
# `apply_rotary_emb` inserts the heads dimension into the frequencies.
_COMPLEX_ROPE_HEADS_AXIS = {
    "transformers.models.llama4.modeling_llama4": 2,  # q, k: (batch, seq, heads, head_dim)
    "transformers.models.deepseek_v2.modeling_deepseek_v2": 1,  # q, k: (batch, heads, seq, head_dim)
}


@dynamic_rope_update
def _real_rotary_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The rotary module's forward with `torch.polar(1, angles)` kept real: (cos, sin) in a last axis of 2."""
    angles = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    return torch.stack((angles.cos(), angles.sin()), dim=-1) * self.attention_scaling


def _rotate(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """`view_as_real(view_as_complex(x) * cis)` with `cis` given as (cos, sin) pairs, in float32."""
    real, imag = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
    cos, sin = cis.unbind(-1)
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2)


def _real_apply_rotary_emb(heads_axis: int) -> Callable:
    """The real twin of a modeling module's complex `apply_rotary_emb`."""

    def apply_rotary_emb(
        xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cis = freqs_cis.unsqueeze(heads_axis).to(xq.device)
        return _rotate(xq, cis).type_as(xq), _rotate(xk, cis).type_as(xk)

    return apply_rotary_emb


def _complex_rope_sites(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The rotary modules computing `torch.polar` and the attention modules calling the complex
    `apply_rotary_emb`, in the modeling modules this patch knows."""
    rotaries, attentions = [], []
    for module in model.modules():
        cls = type(module)
        if cls.__module__ in _COMPLEX_ROPE_HEADS_AXIS:
            names = names_used(cls)
            if "polar" in names and hasattr(module, "inv_freq"):
                rotaries.append(module)
            elif "apply_rotary_emb" in names:
                attentions.append(module)
    return rotaries, attentions


def _needs_real_rope(model: nn.Module) -> bool:
    rotaries, attentions = _complex_rope_sites(model)
    return bool(rotaries and attentions)


def _make_rope_real(model: nn.Module) -> Undo:
    rotaries, attentions = _complex_rope_sites(model)
    undos = [replace_forward(module, types.MethodType(_real_rotary_forward, module)) for module in rotaries]
    for module in attentions:
        twin = _real_apply_rotary_emb(_COMPLEX_ROPE_HEADS_AXIS[type(module).__module__])
        forward = with_globals(type(module).forward, {"apply_rotary_emb": twin})
        undos.append(replace_forward(module, types.MethodType(forward, module)))
    return undo_all(undos)


PATCH = ModelPatch(
    name="complex_rope",
    description="Rotary embeddings computed with torch.polar/view_as_complex rewritten as real cos/sin "
                "arithmetic: TorchNeuron has no complex dtypes.",
    architectures=("llama4_text", "llama4", "deepseek_v2"),
    applies=_needs_real_rope,
    apply=_make_rope_real,
)
