"""Context-length buckets over one static KV cache.

A static cache of `max_length` slots makes every step attend over, and read, all of them: with a
cache of 2048, a decode step of a 20-token chat reads 2048 keys and values per layer. Here each
layer's keys and values are allocated once at full length, and the layer is given, before each
forward, a view of the first `bucket` slots, the smallest context bucket that holds the sequence
so far. The views share the full tensors' memory, so what one bucket's step wrote is there for
the next bucket's; Transformers' mask is sized by the layer's `max_cache_len`, which follows the
view. Each bucket is one graph (per batch size and query length): the views are made once, since
Dynamo guards the tensors a graph was traced with.
"""

from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer


class ContextWindows:
    """The per-bucket views of one static cache's keys and values, and the bucket in use.

    Args:
        cache (`StaticCache`): a cache whose layers are all Transformers' `StaticLayer`, allocated.
        buckets (`tuple[int, ...]`): the context lengths, ascending; the last is the cache's length.
    """

    def __init__(self, cache: StaticCache, buckets: tuple[int, ...]) -> None:
        self.cache = cache
        self.buckets = buckets
        self._views = {bucket: [_window(layer, bucket) for layer in cache.layers] for bucket in buckets}
        self.length = buckets[-1]

    @staticmethod
    def fit_for(cache: StaticCache) -> bool:
        """Whether every layer of `cache` is a plain static attention layer, allocated (the layers
        whose keys and values a window can narrow: sliding, linear-attention and state-space
        layers hold other states)."""
        return bool(cache.layers) and all(type(layer) is StaticLayer and layer.is_initialized
                                          for layer in cache.layers)

    def use(self, bucket: int) -> None:
        """Gives every layer the window of `bucket`, one of the buckets (see
        `Buckets.context_bucket_for` for the one a length needs)."""
        if bucket != self.length:
            for layer, (keys, values) in zip(self.cache.layers, self._views[bucket], strict=True):
                layer.keys, layer.values, layer.max_cache_len = keys, values, bucket
            self.length = bucket


def _window(layer: StaticLayer, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` slots of a layer's keys and values (the tensors themselves at full length),
    with the static address Transformers gives the full tensors."""
    if length == layer.max_cache_len:
        return layer.keys, layer.values
    views = layer.keys[:, :, :length], layer.values[:, :, :length]
    for view in views:
        torch._dynamo.mark_static_address(view)
    return views
