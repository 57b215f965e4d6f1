"""The engine's attention: Transformers' SDPA attention, with grouped key/value heads read in place.

With grouped-query attention (several query heads per key/value head), Transformers' SDPA attention
repeats each key/value head for its query heads (`repeat_kv`) before a masked attention, unless the
device is one whose kernel takes `enable_gqa` with a mask, which `neuron` is not (TorchNeuron's own
GQA examples repeat the heads too). That repeat is a copy of the whole context of keys and values,
every layer and step: for SmolLM2 (9 query heads over 3 key/value heads) at 8 rows and 2048 positions,
2.3 GB written a decode step, two thirds of the step (see `benchmarks/RESULTS.md`).

`packed_sdpa_attention` gives the same result without the copy: the query heads of a group become
more query rows of their key/value head (`[rows, kv_heads, groups * tokens, head_dim]`, as Transformers'
`pack_gqa` does for one token outside a compiled graph), whose mask is the shared one repeated per
group. The keys and values are read as the cache holds them. It runs in plain SDPA, with no flag a
kernel may lack.

The engine's steps run with it in place of `"sdpa"` (`packed_attention`: the model's config names it for
the step's duration, which its compiled graphs are guarded on); models with another attention are left as
they are. (A forward of the same model on another thread during a step would run it too, and a graph of
that forward compiled then would be compiled again after.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "neuron_packed_sdpa"


def packed_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Transformers' `sdpa_attention_forward`, reading grouped key/value heads without repeating them
    (see the module's docstring). Calls it unchanged where the packing does not apply: no groups, no
    mask (a causal flag aligns with the query rows, which packing reorders), a mask per head, or a
    position bias.

    Args and returns as `transformers.integrations.sdpa_attention.sdpa_attention_forward`.
    """
    rows, heads, tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    if (heads == kv_heads or attention_mask is None or attention_mask.shape[1] != 1
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = heads // kv_heads
    # Query head h reads key/value head h // groups (as `repeat_kv` lays them out): row g * tokens + t of
    # key/value head k is token t of query head k * groups + g, whose mask is token t's.
    packed = query.reshape(rows, kv_heads, groups * tokens, head_dim)
    mask = attention_mask.expand(-1, 1, tokens, -1)[:, :, None].expand(-1, -1, groups, -1, -1)
    mask = mask.reshape(mask.shape[0], 1, groups * tokens, -1)
    output = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout,
                                                              scale=scaling)
    # (the batch as SDPA broadcast it, and the values' head size, as Transformers' own attention reads them)
    return output.reshape(output.shape[0], heads, tokens, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)  # (masks as SDPA's: a model may build one)


def takes_boolean_mask(model: PreTrainedModel) -> bool:
    """Whether the model's attention takes a boolean mask (SDPA, plain or packed), not an additive one."""
    return model.config._attn_implementation in ("sdpa", PACKED_SDPA)


@contextlib.contextmanager
def packed_attention(model: PreTrainedModel) -> Iterator[None]:
    """Within: the parts of a model whose attention is SDPA (its config, and each of its sub-configs, e.g.
    a vision tower's) run `packed_sdpa_attention` instead; every part's own choice is restored after."""
    config = model.config
    before = {"": config._attn_implementation}
    for key in config.sub_configs:
        sub_config = getattr(config, key, None)
        if sub_config is not None:
            before[key] = sub_config._attn_implementation
    if "sdpa" not in before.values():
        yield
        return
    # (Transformers' setter takes a dict: "" names the config itself, the other keys its sub-configs.)
    config._attn_implementation = {key: PACKED_SDPA if value == "sdpa" else value for key, value in before.items()}
    try:
        yield
    finally:
        config._attn_implementation = before
