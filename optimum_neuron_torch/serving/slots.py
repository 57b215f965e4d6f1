"""The KV cache of a server: one row per decode slot, each row at its own position.

Transformers' `StaticCache` writes every row of a batch at one shared position (`cumulative_length`),
which suits a batch that starts together. A server's batch does not: requests join and leave at any
step, so each slot (row) of the cache is at its own length. `SlotCache` keeps Transformers' static
layers' tensors (allocated once, fixed shapes) and writes the keys and values of each row at the
positions the step gives (`SlotWrites`); the attention mask of each row, built in the graph from
the same positions, lets a query see its own row's keys up to its own position.

Two kinds of step run on it, each a compiled graph of fixed shapes (see `slot_step`):

- a prefill: one request's prompt, right-padded to a prompt bucket, written into its slot at
  positions 0, 1, ..., attending over those positions only; it returns the first new token;
- a decode step: one token for each of the first `batch` slots (a batch bucket), each at its own
  position, attending over the first `context` positions of the cache (a context bucket); it
  returns the next token of each slot.

With the KV cache, each slot keeps what the penalties read (`TokenCounts`): which tokens its prompt
and answer hold, and how many times each was generated, updated by the steps that sample.

The pad tokens after a prompt write keys that no query reads: a row's decode step at position `p`
writes `p` before it attends, and attends to positions up to `p` only. A free slot in a decode batch
writes at position 0, which the next prefill in that slot overwrites.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from .. import errors
from ..generation.sampling import SamplingParameters, penalize, sample
from .requests import PENALTIES, TAKEN, WARPERS


@dataclass
class SlotWrites:
    """Where the step about to run writes, set on the host before each call (the layers share it).

    Args:
        positions (`torch.Tensor`): int64 `[rows, tokens]`, the position of each token fed.
        slot (`torch.Tensor` or `None`): int64 `[1]`, the slot a prefill writes (its one row); None for
            a decode step, whose rows are the first slots of the cache.
        context (`int`): how many positions of each row the step attends over.
    """

    positions: torch.Tensor | None = None
    slot: torch.Tensor | None = None
    context: int = 0


class SlotLayer(StaticLayer):
    """A static layer whose rows are written at their own positions (see `SlotWrites`).

    Its keys and values are held as `[slots * max_length, heads, head_dim]`, slot-major, so that a
    step writes each (row, position) with one `index_copy_` into the layer's own tensor, as
    Transformers' static layers write theirs (the compiler does that in place; a scatter into a
    view of the cache costs a copy of the view), and reads each row's first positions as a view."""

    def __init__(self, max_cache_len: int, writes: SlotWrites) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.writes = writes

    def allocate(self, slots: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.slots, self.num_heads, self.dtype, self.device = slots, heads, dtype, device
        self.k_head_dim = self.v_head_dim = head_dim
        self.keys = torch.zeros((slots * self.max_cache_len, heads, head_dim), dtype=dtype, device=device)
        self.values = torch.zeros((slots * self.max_cache_len, heads, head_dim), dtype=dtype, device=device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        writes = self.writes
        rows, heads, _, head_dim = key_states.shape
        first = writes.slot if writes.slot is not None else torch.arange(rows, device=key_states.device)
        index = (first[:, None] * self.max_cache_len + writes.positions).reshape(-1)  # [rows * tokens]
        self.keys.index_copy_(0, index, key_states.transpose(1, 2).reshape(-1, heads, head_dim))
        self.values.index_copy_(0, index, value_states.transpose(1, 2).reshape(-1, heads, head_dim))
        keys = self.keys.view(self.slots, self.max_cache_len, heads, head_dim)
        values = self.values.view(self.slots, self.max_cache_len, heads, head_dim)
        if writes.slot is not None:  # a prefill: its slot's row
            keys, values = keys.index_select(0, writes.slot), values.index_select(0, writes.slot)
        else:  # a decode step: the first rows
            keys, values = keys[:rows], values[:rows]
        return keys[:, : writes.context].transpose(1, 2), values[:, : writes.context].transpose(1, 2)


class TokenCounts:
    """Per slot, on the device: which tokens its prompt and answer hold (`seen`, 0 or 1) and how
    many times each was generated (`counts`), float32 `[slots, vocab]`: what the penalties read
    (see `sampling.penalize`). The steps that sample update them in their graph (`update`), so the
    host sends nothing for them."""

    def __init__(self, slots: int, vocab: int, device: torch.device) -> None:
        self.seen = torch.zeros((slots, vocab), dtype=torch.float32, device=device)
        self.counts = torch.zeros((slots, vocab), dtype=torch.float32, device=device)

    def read(self, rows: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor,
             prefill: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`seen` and `counts` of the slots `rows` for this step: a prefill piece marks its prompt
        tokens (up to `last`), and the first piece of a prompt (at position 0) starts from zero."""
        seen, counts = self.seen.index_select(0, rows), self.counts.index_select(0, rows)
        if prefill:
            first = positions[:, :1] == 0
            seen, counts = seen.masked_fill(first, 0.0), counts.masked_fill(first, 0.0)
            prompt = (torch.arange(input_ids.shape[1], device=input_ids.device) <= last)[None, :].float()
            seen = torch.maximum(seen, torch.zeros_like(seen).scatter_add(1, input_ids, prompt).clamp(max=1.0))
        return seen, counts

    def update(self, rows: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor,
               taken: torch.Tensor) -> None:
        """Writes back the slots `rows`, each with its chosen token counted where `taken` is 1."""
        chosen = torch.zeros_like(counts).scatter(1, tokens[:, None], taken[:, None])
        self.seen.index_copy_(0, rows, torch.maximum(seen, chosen))
        self.counts.index_copy_(0, rows, counts + chosen)


class SlotCache(StaticCache):
    """Transformers' static cache of `slots` rows of `max_length` positions, each row written at its
    own positions (see the module's docstring)."""

    def __init__(self, model: PreTrainedModel, slots: int, max_length: int) -> None:
        config = model.config.get_text_config(decoder=True)
        super().__init__(config=config, max_cache_len=max_length)
        why = unsupported_by_slots(model, self)
        if why is not None:
            raise errors.ConfigurationError(f"cannot serve model type {model.config.model_type!r}: {why}")
        self.writes = SlotWrites()
        self.tokens = TokenCounts(slots, model.config.get_text_config(decoder=True).vocab_size, model.device)
        self.layers = [SlotLayer(max_length, self.writes) for _ in self.layers]
        num_heads, head_dim = model._get_static_cache_init_shape()
        for index, layer in enumerate(self.layers):
            layer.allocate(slots, num_heads[index] if isinstance(num_heads, list) else num_heads,
                           head_dim[index] if isinstance(head_dim, list) else head_dim, model.dtype, model.device)


def unsupported_by_slots(model: PreTrainedModel, cache: StaticCache) -> str | None:
    """Why a slot cache cannot serve `model`, or None. It needs a decoder whose forward takes
    `position_ids` and a 4D attention mask as they are, and whose cache layers are all full
    attention (a sliding window needs a mask of its own; state-space layers keep no positions)."""
    if model.config.is_encoder_decoder:
        return "encoder-decoder models are not served (a decoder-only causal language model is)"
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return "its forward takes no position_ids, which each slot's own positions need"
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer}
    if kinds:
        return (f"its cache has {', '.join(sorted(kinds))} layers; serving holds full-attention layers only "
                "(sliding windows, linear attention and state-space layers are not served yet)")
    return None


def slot_step(model: PreTrainedModel, cache: SlotCache, input_ids: torch.Tensor, positions: torch.Tensor,
              last: torch.Tensor, sampling: torch.Tensor, uniform: torch.Tensor, sampled: bool) -> torch.Tensor:
    """What gets compiled: one step of the slots in `cache.writes` (a prefill or a decode step, see
    the module's docstring), returning the token chosen for each row.

    Args:
        input_ids (`torch.Tensor`): int64 `[rows, tokens]`.
        positions (`torch.Tensor`): int64 `[rows, tokens]`, each token's position in its slot.
        last (`torch.Tensor`): int64 `[1]`, the token whose logits choose the next one (the prompt's
            last real token in a prefill; 0 in a decode step).
        sampling (`torch.Tensor`): float32 `[rows, 9]`, each row's `SamplingSettings.row`: the
            warpers' parameters (a temperature of 0 chooses the greedy token), the penalties, and
            whether its token is taken (counted for the penalties).
        uniform (`torch.Tensor`): float32 `[rows]`, the uniform numbers sampled rows draw with.
        sampled (`bool`): whether any row samples or has penalties; if not, the graph takes the argmax
            only (a graph of its own: sampling sorts the vocabulary of each row, a third of a decode
            step of SmolLM2 at batch 8).

    Returns:
        `torch.Tensor`: int64 `[rows]`.
    """
    keys = torch.arange(cache.writes.context, device=positions.device)
    mask = keys[None, None, None, :] <= positions[:, None, :, None]  # [rows, 1, tokens, context]
    logits = model(input_ids=input_ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True,
                   logits_to_keep=last).logits[:, -1]
    if not sampled:
        return logits.argmax(-1)
    prefill = cache.writes.slot is not None
    rows = cache.writes.slot if prefill else torch.arange(input_ids.shape[0], device=input_ids.device)
    seen, counts = cache.tokens.read(rows, input_ids, positions, last, prefill)
    logits = penalize(logits, sampling[:, PENALTIES], seen, counts)
    greedy = sampling[:, 0] == 0
    # (a greedy row samples without warpers, which keeps its arithmetic finite, and takes the argmax)
    neutral = torch.tensor(SamplingParameters().row(), device=sampling.device)
    parameters = torch.where(greedy[:, None], neutral, sampling[:, WARPERS])
    tokens = torch.where(greedy, logits.argmax(-1), sample(logits, parameters, uniform))
    cache.tokens.update(rows, seen, counts, tokens, sampling[:, TAKEN])
    return tokens
