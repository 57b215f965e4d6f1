"""The static caches of the static-graph path (`static_graphs`): allocated once per batch bucket
(and encoder bucket) with Transformers' static layers, and answering their length as the loop and
the compiled graphs need it."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, PendingUnbackedSymbolNotFound
from transformers import EncoderDecoderCache, PreTrainedModel, StaticCache
from transformers.cache_utils import (
    LinearAttentionAndStaticFullAttentionLayer,
    LinearAttentionAndStaticSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from .padding import pad_token_id
from .slots import early_shape_fits


def allocate(model: PreTrainedModel, max_length: int, batch: int, encoder_length: int | None,
             length_as_scalar: bool, states_only: bool) -> StaticCache | EncoderDecoderCache:
    """The static cache of `model` for `batch` rows of `max_length` positions (with a cross-attention
    cache of `encoder_length`, for encoder-decoders), allocated now.

    Its layers are Transformers' static layers for the model's layer types (attention, linear
    attention, state-space, hybrid). Layers whose shapes Transformers cannot tell in advance
    (multi-head latent attention, convolution and recurrent states) are allocated by one eager
    decode step of one token: were they allocated inside the first compiled call, the next call
    would meet allocated layers and compile again. Its `get_seq_length` answers as `CacheLength`
    says (as `_scalar_cache_length` says with `length_as_scalar`; 0 while empty with `states_only`)."""
    config = model.config.get_text_config(decoder=True)
    lengths = [max_length] + ([encoder_length] if encoder_length is not None else [])
    caches = [StaticCache(config=config, max_cache_len=length) for length in lengths]
    attention = any(getattr(layer, "supports_early_init", False) for layer in caches[0].layers)
    init_shape = model._get_static_cache_init_shape() if attention else None
    if init_shape is not None and not early_shape_fits(model, config, init_shape, caches[0].layers):
        init_shape = None  # (the eager step below sizes the layers from the model's own keys and values)
    for cache, length in zip(caches, lengths, strict=True):
        cache.layers = [_without_sliding_window(layer, length) for layer in cache.layers]
        if init_shape is not None:
            num_heads, head_dim = init_shape
            cache.early_initialization(batch_size=batch, num_heads=num_heads, head_dim=head_dim,
                                       dtype=model.dtype, device=model.device)
    cache = EncoderDecoderCache(*caches) if len(caches) == 2 else caches[0]
    if encoder_length is None and not all(_allocated(layer) for layer in cache.layers):
        token = pad_token_id(model.generation_config, model.get_input_embeddings().num_embeddings)
        ids = torch.full((batch, 1), token, dtype=torch.long, device=model.device)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True)
    decoder_cache = cache.self_attention_cache if encoder_length is not None else cache
    decoder_cache.get_seq_length = CacheLength(decoder_cache)
    if length_as_scalar:
        _scalar_cache_length(decoder_cache)
    if states_only:
        _empty_length_known(cache)
    return cache


def holds_states_only(model: PreTrainedModel) -> bool:
    """Whether a decoder's cache holds state-space (or linear-attention) states only, which
    Transformers can neither measure nor prefill in chunks (see `_empty_length_known`)."""
    if model.config.is_encoder_decoder:
        return False
    try:
        cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=1)
    except Exception:  # (a config the static cache cannot read: `allocate` fails the same way, and degrades)
        return False
    return all(cache.is_linear)


def sizes_by_cache_length(error: BaseException) -> bool:
    """Whether a compiled forward failed because the model sizes or branches on the cache's length,
    which a static cache holds as a tensor (Dynamo then meets data-dependent sizes)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, GuardOnDataDependentSymNode | PendingUnbackedSymbolNotFound):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


class CacheLength:
    """A cache instance's `get_seq_length()`: the length at the time of the call, told by the host
    while Transformers prepares a step's inputs there.

    Transformers' static layers return their length tensor itself, which their next update
    increments in place: a model that reads the length before updating the cache and uses it after
    (Inkling's query positions) would see the new length (the CPU's dynamic cache returns an int),
    so the device's answer is a copy. And Transformers' loop, which builds each step's masks on the
    host, reads the length there every step: read from the device, that is a synchronization a
    step; the host knows it already (see `StaticGraphs.length_from_host`)."""

    def __init__(self, cache: StaticCache) -> None:
        self._ask_cache = cache.get_seq_length
        self.on_host: int | None = None  # the length, while the host knows it

    def __call__(self, layer_idx: int = 0) -> Any:
        length = self._ask_cache(layer_idx)  # (the layer's tensor itself: no transfer)
        if not isinstance(length, torch.Tensor):
            return length
        if self.on_host is not None and not torch.compiler.is_compiling():
            return torch.tensor(self.on_host, dtype=length.dtype)
        return length.clone()


def _without_sliding_window(layer: Any, length: int) -> Any:
    """The cache layer to use for `layer`: sliding-window layers branch on a Python int that Dynamo
    specializes on (a new graph per step), so they become full layers of `length` slots, which the
    model's sliding-window mask makes compute the same."""
    if type(layer) is StaticSlidingWindowLayer:
        return StaticLayer(max_cache_len=length)
    if type(layer) is LinearAttentionAndStaticSlidingWindowAttentionLayer:
        return LinearAttentionAndStaticFullAttentionLayer(max_cache_len=length,
                                                          number_of_states=layer.number_of_states)
    return layer


def _scalar_cache_length(cache: StaticCache) -> None:
    """Makes this cache instance's `get_seq_length()` a scalar read from the device (Dynamo traces it
    as one symbolic size) instead of the layer's length tensor: positions a model computes as
    `arange(length, length + n)` then have the static size n, which tensors' values could not give.
    Each call reads the length from the device, which splits the graph there."""

    def get_seq_length(layer_idx: int = 0) -> int:
        length = cache.layers[layer_idx].get_seq_length()
        return int(length.item()) if isinstance(length, torch.Tensor) else length

    cache.get_seq_length = get_seq_length


def _empty_length_known(cache: StaticCache) -> None:
    """Makes this cache instance answer `get_seq_length()` while it is empty (0): Transformers'
    chunked prefill asks it once, before the first chunk, and Transformers' cache refuses the
    question when only state-space layers hold the states. Once states are written it refuses as
    before. Such a cache is prefilled in one chunk only (`StaticGraphs._plan`): Mamba's scan over a
    prompt starts from a zero state, so a second chunk would not continue the first."""
    ask_cache = cache.get_seq_length

    def get_seq_length(layer_idx: int = 0) -> int:
        if not any(any(layer.has_previous_state.values()) for layer in cache.layers
                   if isinstance(layer, LinearAttentionCacheLayerMixin)):
            return 0
        return ask_cache(layer_idx)

    cache.get_seq_length = get_seq_length


def _allocated(layer: Any) -> bool:
    """Whether a cache layer holds its tensors (layers without any, such as `DummyLayer`, do)."""
    if isinstance(layer, LinearAttentionCacheLayerMixin) and not all(
            layer.is_conv_states_initialized.values()) and not all(layer.is_recurrent_states_initialized.values()):
        return False
    return getattr(layer, "is_initialized", True)
