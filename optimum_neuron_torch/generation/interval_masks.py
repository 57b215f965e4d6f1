"""Attention masks that cross to the device as intervals.

For a compiled forward, Transformers' generation loop builds each step's attention mask on the
host, [rows, 1, queries, keys] booleans over the whole context bucket, and moves it to the device:
with a context of 2048, 2 KB a sequence and step, where the token id is 8 bytes. In generation,
each query's row of such a mask is one interval of keys: from the sequence's first token (after
its left padding) to the query's own position, or from the start of its window for a sliding-
window layer. So the host sends each row's two bounds and the compiled step rebuilds the mask
(`expand`: an `arange` and two comparisons). A mask that is not made of intervals (bidirectional
blocks, image tokens, masks of floats) crosses as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class IntervalMask:
    """A boolean attention mask `[..., length]` held as the bounds of each row's single interval
    of `True`: `bounds[..., 0] <= key < bounds[..., 1]` (an empty row has equal bounds).

    Args:
        bounds (`torch.Tensor`): int32 `[..., 2]`, the mask's leading shape.
        length (`int`): the number of keys (the mask's last dimension).
    """

    bounds: torch.Tensor
    length: int


def compact(masks: Any) -> Any:
    """`masks` (a mask tensor, or a dict of them per layer type, as Transformers' mask functions
    return) as `IntervalMask`s when every boolean host mask among them is made of intervals, else
    unchanged."""
    if isinstance(masks, dict):
        compacted = {name: _intervals(mask) if isinstance(mask, torch.Tensor) else mask
                     for name, mask in masks.items()}
        if any(compacted[name] is None for name, mask in masks.items() if isinstance(mask, torch.Tensor)):
            return masks  # (one of them is not intervals)
        return compacted
    compacted = _intervals(masks) if isinstance(masks, torch.Tensor) else None
    return masks if compacted is None else compacted


def _intervals(mask: torch.Tensor) -> IntervalMask | None:
    """The intervals of a boolean 4D host mask, or None if a row is not one interval (or the mask
    not such a mask). The mask rebuilt from them is compared with the mask itself."""
    if mask.dtype != torch.bool or mask.ndim != 4 or mask.device.type != "cpu":
        return None
    counts = mask.sum(-1, dtype=torch.int32)
    first = torch.where(counts > 0, mask.int().argmax(-1).int(), 0)
    intervals = IntervalMask(torch.stack([first, first + counts], dim=-1), mask.shape[-1])
    return intervals if torch.equal(expand(intervals.bounds, intervals.length), mask) else None


def for_graph(masks: Any, device: torch.device) -> Any:
    """`masks` as a compiled step takes them (see `in_graph`): each `IntervalMask` as its bounds,
    moved to `device`, and its length; the other masks as they are."""
    if isinstance(masks, dict):
        return {name: for_graph(mask, device) for name, mask in masks.items()}
    if isinstance(masks, IntervalMask):
        return masks.bounds.to(device), masks.length
    return masks


def in_graph(masks: Any) -> Any:
    """In a compiled step: the masks `for_graph` gave, expanded."""
    if isinstance(masks, dict):
        return {name: in_graph(mask) for name, mask in masks.items()}
    if isinstance(masks, tuple):
        return expand(*masks)
    return masks


def expand(bounds: torch.Tensor, length: int) -> torch.Tensor:
    """The boolean mask `[..., length]` of intervals `bounds` `[..., 2]` (in a compiled graph, or
    on the host to check them)."""
    keys = torch.arange(length, dtype=bounds.dtype, device=bounds.device)
    return (keys >= bounds[..., :1]) & (keys < bounds[..., 1:])
