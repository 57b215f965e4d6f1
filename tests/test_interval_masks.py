"""Attention masks that cross to the device as intervals: exactly the masks of intervals, rebuilt
as they were; any other mask is left as it is."""

from __future__ import annotations

import torch

from optimum_neuron_torch.generation.interval_masks import IntervalMask, compact, expand, for_graph, in_graph


def mask(rows: list[tuple[int, int]], length: int = 10) -> torch.Tensor:
    """A [rows, 1, 1, length] decode-step mask of one interval per row."""
    return expand(torch.tensor(rows, dtype=torch.int32)[:, None, None], length)


def test_masks_of_intervals_are_sent_as_bounds_and_rebuilt_as_they_were():
    padded = mask([(3, 8), (0, 8), (8, 8), (0, 10)])  # (left padding, none, an empty row, a full row)
    sliding = mask([(5, 8), (4, 8), (8, 8), (7, 10)])
    for masks in (padded, {"full_attention": padded, "sliding_attention": sliding, "linear_attention": None}):
        compacted = compact(masks)
        rebuilt = in_graph(for_graph(compacted, torch.device("cpu")))
        if isinstance(masks, dict):
            assert all(isinstance(compacted[name], IntervalMask) for name in ("full_attention", "sliding_attention"))
            assert rebuilt["linear_attention"] is None
            assert all(torch.equal(rebuilt[name], masks[name]) for name in ("full_attention", "sliding_attention"))
        else:
            assert compacted.bounds.tolist() == [[[[3, 8]]], [[[0, 8]]], [[[0, 0]]], [[[0, 10]]]]  # (empty: 0, 0)
            assert torch.equal(rebuilt, masks)


def test_other_masks_cross_as_they_are():
    padded = mask([(3, 8), (0, 8)])
    holed = padded.clone()
    holed[0, 0, 0, 5] = False  # (two intervals in a row: bidirectional blocks, image tokens)
    additive = torch.zeros(2, 1, 1, 10).masked_fill(~padded, torch.finfo(torch.float32).min)
    for masks in (holed, additive, padded[:, 0], {"full_attention": padded, "sliding_attention": holed}):
        assert compact(masks) is masks
