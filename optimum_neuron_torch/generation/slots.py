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

Each also returns the logits the tokens were chosen from, which stay on the device unless a row's
token is chosen on the host (`Request.choose`).

With the KV cache, each slot keeps what the penalties read (`TokenCounts`): which tokens its prompt
and answer hold, and how many times each was generated, updated by the steps that sample.

The pad tokens after a prompt write keys that no query reads: a row's decode step at position `p`
writes `p` before it attends, and attends to positions up to `p` only. A free slot in a decode batch
writes at the step's last position (which the prefix cache then forgets the slot holds).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from .. import errors
from ..compiler import regions
from ..compiler.dynamo_backend import recording_cache_keys
from .attention import packed_attention, takes_boolean_mask
from .buckets import Buckets, PlannedGraph, engine_plan
from .compiling import COMPILE_CONFIG, QUIET_WHILE_TRACED
from .images import ImageEncoder, prompt_embeddings
from .requests import ADAPTER, MAX_LOGPROBS, NO_PENALTIES, PENALTIES, TAKEN, WARPERS, SamplingSettings
from .sampling import penalize, sample
from .split_model import StepBroadcast, embeddings_without_padding_index, tensor_parallel_mesh, whole_graphs_reason
from .static_plans import image_placeholder

logger = logging.getLogger(__name__)


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

    Its keys and values are held as `[slots * heads * max_length, head_dim]`: slot-major, then head-major
    as Transformers' static layers (`[batch, heads, positions, head_dim]`), so that a step writes each
    (row, head, position) with one `index_copy_` into the layer's own tensor, as Transformers' static
    layers write theirs (the compiler does that in place; a scatter into a view of the cache costs a
    copy of the view), and reads each head of a row's first positions as one contiguous view (a head's
    positions a stride apart, with the heads of a position side by side, read 3x slower on the CPU
    behind the reference device, see `benchmarks/RESULTS.md`)."""

    def __init__(self, max_cache_len: int, writes: SlotWrites) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.writes = writes

    def allocate(self, slots: int, heads: int, key_width: int, value_width: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.slots, self.num_heads, self.dtype, self.device = slots, heads, dtype, device
        self.k_head_dim, self.v_head_dim = key_width, value_width
        self.keys = torch.zeros((slots * heads * self.max_cache_len, key_width), dtype=dtype, device=device)
        self.values = torch.zeros((slots * heads * self.max_cache_len, value_width), dtype=dtype, device=device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        writes = self.writes
        rows, heads = key_states.shape[:2]
        first = writes.slot if writes.slot is not None else torch.arange(rows, device=key_states.device)
        row_heads = first[:, None] * heads + torch.arange(heads, device=key_states.device)[None, :]  # [rows, heads]
        index = (row_heads[:, :, None] * self.max_cache_len + writes.positions[:, None, :]).reshape(-1)
        self.keys.index_copy_(0, index, key_states.reshape(-1, self.k_head_dim))  # ([rows, heads, tokens] order)
        self.values.index_copy_(0, index, value_states.reshape(-1, self.v_head_dim))
        keys = self.keys.view(self.slots, heads, self.max_cache_len, self.k_head_dim)
        values = self.values.view(self.slots, heads, self.max_cache_len, self.v_head_dim)
        if writes.slot is not None:  # a prefill: its slot's row
            keys, values = keys.index_select(0, writes.slot), values.index_select(0, writes.slot)
        else:  # a decode step: the first rows
            keys, values = keys[:rows], values[:rows]
        return keys[:, :, : writes.context], values[:, :, : writes.context]


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
        # Sliding-window layers become full ones, which the sliding mask `slot_step` gives them narrows
        # (a sliding layer's own ring of positions would be a graph per step).
        sliding = [type(layer) is StaticSlidingWindowLayer for layer in self.layers]
        self.sliding_window: int | None = config.sliding_window if any(sliding) else None
        self.mixed_layers = any(sliding) and not all(sliding)  # (then the model takes a mask per layer type)
        self.layers = [SlotLayer(max_length, self.writes) for _ in self.layers]
        for layer, shape in zip(self.layers, head_shapes(model, config, self.layers), strict=True):
            layer.allocate(slots, *shape, model.dtype, model.device)


def unsupported_by_slots(model: PreTrainedModel, cache: StaticCache) -> str | None:
    """Why a slot cache cannot serve `model`, or None. It needs a decoder whose forward takes
    `position_ids` and a 4D attention mask as they are (or, with sliding-window layers among full
    ones, a mask per layer type), and whose cache layers are all attention layers, full or sliding
    (state-space and linear-attention layers keep no positions)."""
    if model.config.is_encoder_decoder:
        return "encoder-decoder models are not served (a decoder-only causal language model is)"
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return "its forward takes no position_ids, which each slot's own positions need"
    kinds = [type(layer) for layer in cache.layers]
    others = {kind.__name__ for kind in kinds if kind not in (StaticLayer, StaticSlidingWindowLayer)}
    if others:
        return (f"its cache has {', '.join(sorted(others))} layers; the engine's slots hold attention layers only "
                "(linear attention and state-space layers are not served yet)")
    if len(set(kinds)) > 1 and not getattr(model.config.get_text_config(decoder=True), "layer_types", None):
        return "its sliding-window and full layers are not named by `layer_types`, which a mask per layer type needs"
    return None


def early_shape_fits(model: PreTrainedModel, config: Any, init_shape: tuple[Any, Any], layers: list[Any]) -> bool:
    """Whether the `(num_heads, head_dim)` Transformers reads from the config to initialize a static
    cache early fits the keys and values the model writes: an attention layer whose `k_proj`/`v_proj`
    is wider or narrower than that (MiMo-V2-Flash: sliding layers with twice the heads, values of
    their own width) would fail its first cache update; so would a multi-query config (Falcon's,
    GPTBigCode's: one key/value head written) whose `num_key_value_heads` says more, which Transformers
    reads as given. (Fused projections, GPT-2's or T5's, have nothing to compare: their shapes are
    Transformers'.)"""
    if tensor_parallel_mesh(model) is not None:  # (sharded projections: Transformers' shape is per rank)
        return True
    num_heads, head_dim = init_shape
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False) and any(
            heads != 1 for heads in (num_heads if isinstance(num_heads, list) else [num_heads])):
        return False
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if not isinstance(index, int) or index >= len(layers) or not getattr(layers[index], "supports_early_init",
                                                                            False):
            continue
        heads = num_heads[index] if isinstance(num_heads, list) else num_heads
        width = head_dim[index] if isinstance(head_dim, list) else head_dim
        for projection in (getattr(module, "k_proj", None), getattr(module, "v_proj", None)):
            if isinstance(projection, torch.nn.Linear) and projection.out_features != heads * width:
                return False
    return True


def head_shapes(model: PreTrainedModel, config: Any, layers: list[Any]) -> list[tuple[int, int, int]]:
    """Per cache layer, the `(heads, key width, value width)` of the keys and values the model
    writes: those Transformers reads from the config when they fit (`early_shape_fits`), else those
    of one eager step of one token into Transformers' dynamic cache (layers with heads or value widths
    of their own)."""
    init_shape = model._get_static_cache_init_shape()
    if init_shape is not None and early_shape_fits(model, config, init_shape, layers):
        num_heads, head_dim = init_shape
        return [(num_heads[index] if isinstance(num_heads, list) else num_heads,
                 *(2 * [head_dim[index] if isinstance(head_dim, list) else head_dim])) for index in range(len(layers))]
    cache = DynamicCache(config=config)
    ids = torch.zeros((1, 1), dtype=torch.long, device=model.device)
    with torch.no_grad():
        model(input_ids=ids, position_ids=ids, cache=cache, use_cache=True)
    return [(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1]) for layer in cache.layers]


def slot_step(model: PreTrainedModel, cache: SlotCache, input_ids: torch.Tensor, positions: torch.Tensor,
              last: torch.Tensor, sampling: torch.Tensor, uniform: torch.Tensor, sampled: bool,
              targets: torch.Tensor | None = None, verify: bool = False,
              inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """What gets compiled: one step of the slots in `cache.writes` (a prefill or a decode step, see
    the module's docstring), returning the token chosen for each row, and the logits it was chosen
    from (before the penalties), which stay on the device unless the host chooses a row's token.

    Args:
        input_ids (`torch.Tensor`): int64 `[rows, tokens]`.
        positions (`torch.Tensor`): int64 `[rows, tokens]`, each token's position in its slot.
        last (`torch.Tensor`): int64 `[1]`, the token whose logits choose the next one (the prompt's
            last real token in a prefill; 0 in a decode step).
        sampling (`torch.Tensor`): float32 `[rows, 9]`, each row's `Request.row` but its adapter
            (which the host hands the layers, see `lora_adapters`): the warpers' parameters (a
            temperature of 0 chooses the greedy token), the penalties, and whether its token is
            taken (counted for the penalties).
        uniform (`torch.Tensor`): float32 `[rows]`, the uniform numbers sampled rows draw with.
        sampled (`bool`): whether any row samples or has penalties; if not, the graph takes the argmax
            only (a graph of its own: sampling sorts the vocabulary of each row, a third of a decode
            step of SmolLM2 at batch 8).
        targets (`torch.Tensor`, *optional*): int64 `[1, tokens]`, for a prefill piece that scores
            its prompt (a graph of its own, see `buckets.engine_plan`): the token that follows each
            position (what the model is scored on predicting there).
        verify (`bool`): for a piece of speculative decoding (its own graphs, see `speculation`): the
            greedy token after every position instead (`sampling` and `uniform` unread).
        inputs_embeds (`torch.Tensor`, *optional*): `[rows, tokens, hidden]`, what the model reads
            instead of `input_ids` (a vision-language model's prefill: its images' features in their
            places, see `images.prompt_embeddings`); `input_ids` still tell the penalties the tokens.

    Returns:
        `tuple[torch.Tensor, ...]`: the tokens, int64 `[rows]`, and the logits of the position that
        chose them, `[rows, vocab]` in the model's dtype; with `targets`, also the scores of each
        position (the log-probability of its target, and the `MAX_LOGPROBS` largest ones with their tokens:
        float32 `[tokens]`, float32 and int64 `[tokens, MAX_LOGPROBS]`), from its raw logits. With
        `verify`, the tokens and logits of every position of its one row (`[tokens]`, `[tokens, vocab]`).
    """
    keys = torch.arange(cache.writes.context, device=positions.device)[None, None, None, :]
    queries = positions[:, None, :, None]
    mask = keys <= queries  # [rows, 1, tokens, context]
    if cache.sliding_window is not None:  # (as Transformers' `sliding_window_overlay`)
        sliding = _as_attention_takes(mask & (keys > queries - cache.sliding_window), model)
        mask = _as_attention_takes(mask, model)
        mask = {"full_attention": mask, "sliding_attention": sliding} if cache.mixed_layers else sliding
    else:
        mask = _as_attention_takes(mask, model)
    given = {"input_ids": input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
    if verify:  # (the greedy token after each position, as a decode step without penalties takes it)
        logits = model(**given, position_ids=positions, attention_mask=mask, cache=cache,
                       use_cache=True).logits[0]
        return logits.argmax(-1), logits
    if targets is None:
        logits = model(**given, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True,
                       logits_to_keep=last).logits[:, -1]
        scores = ()
    else:  # (the logits of every position: the head reads them all)
        every = model(**given, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True).logits
        logits = every.index_select(1, last)[:, -1]
        logprobs = every[0].float().log_softmax(-1)
        top = logprobs.topk(MAX_LOGPROBS)
        scores = (logprobs.gather(-1, targets[0, :, None])[:, 0], top.values, top.indices)
    if not sampled:
        return logits.argmax(-1), logits, *scores
    prefill = cache.writes.slot is not None
    rows = cache.writes.slot if prefill else torch.arange(input_ids.shape[0], device=input_ids.device)
    seen, counts = cache.tokens.read(rows, input_ids, positions, last, prefill)
    penalized = penalize(logits, sampling[:, PENALTIES], seen, counts)
    greedy = sampling[:, 0] == 0
    # (a greedy row samples at temperature 1, which keeps its arithmetic finite, and takes the argmax)
    warpers = sampling[:, WARPERS]
    parameters = torch.cat([torch.where(greedy, 1.0, warpers[:, 0])[:, None], warpers[:, 1:]], dim=1)
    tokens = torch.where(greedy, penalized.argmax(-1), sample(penalized, parameters, uniform))
    cache.tokens.update(rows, seen, counts, tokens, sampling[:, TAKEN])
    return tokens, logits, *scores


def _as_attention_takes(mask: torch.Tensor, model: PreTrainedModel) -> torch.Tensor:
    """A boolean mask (True: attended) as the model's attention takes it, as Transformers' masks
    are made: boolean for SDPA, else (eager attention adds it to the scores) 0 where attended and the
    dtype's lowest value elsewhere."""
    if takes_boolean_mask(model):
        return mask
    return torch.where(mask, 0.0, torch.finfo(model.dtype).min).to(model.dtype)


def dummy_step(graph: PlannedGraph, pad_token_id: int) -> tuple[Any, ...]:
    """The arguments of `SlotSteps.forward` that run `graph` (of `buckets.engine_plan`) on pad tokens,
    in slot 0 or the first slots: what it writes there, a request's prefill writes again."""
    context, sampled = graph.context, SamplingSettings(temperature=1.0).row(taken=False)
    if graph.role.endswith(("prefill", "chunk", "suffix", "verify")):
        targets = [[pad_token_id] * graph.tokens] if graph.role.startswith("scoring") else None
        return ([[pad_token_id] * graph.tokens], [list(range(context - graph.tokens, context))], 0, context, [0.5],
                [sampled], 0, targets, graph.role == "verify")
    sampling = sampled if graph.role == "sampling decode" else SamplingSettings().row(taken=False)
    return ([[pad_token_id]] * graph.batch, [[context - 1]] * graph.batch, 0, context, [0.5] * graph.batch,
            [sampling] * graph.batch, None, None, False)


class SlotSteps:
    """The device side of the generation engine: its `SlotCache` of a slot per row of the largest
    batch bucket, and its compiled `slot_step`, called with a step's host inputs (`forward`).

    Args:
        model (`PreTrainedModel`): the model.
        buckets (`Buckets`): the engine's buckets.
        broadcast (`StepBroadcast`, *optional*): for a model split between ranks, on rank 0: each
            step's inputs go to the other ranks first, which run them (`run`).
    """

    def __init__(self, model: PreTrainedModel, buckets: Buckets, broadcast: StepBroadcast | None = None) -> None:
        self._model = weakref.ref(model)  # (the model holds its engine: no cycle, it frees on `del`)
        self.cache = SlotCache(model, buckets.batch_sizes[-1], buckets.max_length)
        self.step = regions.compile_by_layer(slot_step, whole_because=whole_graphs_reason(model),
                                             **COMPILE_CONFIG.to_dict())
        self.broadcast = broadcast
        # A vision-language model's images (see `images`): every prefill then reads embeddings.
        self.images = ImageEncoder(model) if image_placeholder(model) is not None else None
        if self.images is not None and broadcast is not None:
            raise errors.ConfigurationError("a vision-language model cannot be split between ranks yet")
        self.graphs = len(engine_plan(buckets, scoring=True, prefix_caching=True)) + len(buckets.batch_sizes)
        self.cache_keys: set[str] = set()  # the compile-cache entries of the graphs run (saved with the model)
        self.adapters: Any = None  # the LoRA adapters attached (`lora_adapters.AdapterSlots`), if any
        self.lock = threading.Lock()  # held by each step (what changes the adapters' weights waits for it)

    @property
    def model(self) -> PreTrainedModel:
        return self._model()

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """Around the steps: no autograd (grad mode is per thread), Dynamo may keep a graph per
        bucket and traces logging calls as nothing (a model's `logger.warning_once` in its forward
        would break the graph), the compile-cache entries of the graphs run are recorded, and a
        split embedding has no padding index (see `embeddings_without_padding_index`)."""
        try:
            with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=self.graphs + 8,
                                                             accumulated_recompile_limit=max(256, 2 * self.graphs),
                                                             ignore_logging_functions=QUIET_WHILE_TRACED), \
                    recording_cache_keys() as keys, embeddings_without_padding_index(self.model):
                yield
        finally:
            self.cache_keys |= keys

    def forward(self, ids: list[list[int]], positions: list[list[int]], last: int, context: int,
                uniform: list[float], sampling: list[list[float]], slot: int | None = None,
                targets: list[list[int]] | None = None, verify: bool = False, images: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """One step (a prefill piece into `slot`, or a decode step of the first slots, see `slot_step`),
        sent to the other ranks first if split: the chosen tokens, on the host, the logits they
        were chosen from, on the device, and with `targets` the scores of the piece's positions, on
        the host (else an empty tuple); with `verify`, the greedy token of each position (`slot_step`).
        `images`: the features of the piece's image placeholders (a vision-language model's)."""
        if self.broadcast is not None:
            self.broadcast.send((ids, positions, last, context, uniform, sampling, slot, targets, verify))
        return self.run(ids, positions, last, context, uniform, sampling, slot, targets, verify, images)

    def run(self, ids: list[list[int]], positions: list[list[int]], last: int, context: int,
            uniform: list[float], sampling: list[list[float]], slot: int | None,
            targets: list[list[int]] | None = None, verify: bool = False, images: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """One step on this rank. A prefill always runs the graph that can sample (one row: it costs
        little); a decode step, only if a row samples or has penalties."""
        with self.lock, self._inputs(ids, positions, last, context, uniform, sampling, slot, targets,
                                     verify, images) as inputs:
            tokens, logits, *scores = self.step(self.model, self.cache, *inputs)
            return tokens.cpu(), logits, tuple(score.cpu() for score in scores)

    def follow(self) -> None:
        """On a rank other than 0 of a split model: runs the device calls rank 0's engine sends, until
        it stops."""
        with self.compiling():
            while (call := self.broadcast.receive()) is not None:
                try:
                    self.run(*call)
                except errors.DEVICE_OR_JOB_FAILURES:
                    raise
                except Exception:  # (rank 0 met it too: the step's requests fail, the engine goes on)
                    logger.exception("a step failed on this rank; the next one runs")

    def reuse(self, slot: int, donor: int | None, prefix: list[int]) -> None:
        """Readies `slot` for a request whose first `len(prefix)` positions its cache holds already:
        copied from slot `donor` (if not None: eager copies, a layer at a time), and what the
        penalties read of them (the prefix's tokens seen, none generated)."""
        with torch.no_grad():
            if donor is not None and prefix:
                for layer in self.cache.layers:
                    for tensor in (layer.keys, layer.values):
                        rows = tensor.view(layer.slots, layer.num_heads, layer.max_cache_len, tensor.shape[-1])
                        rows[slot, :, :len(prefix)] = rows[donor, :, :len(prefix)]
            counts = self.cache.tokens
            counts.seen[slot], counts.counts[slot] = 0.0, 0.0
            if prefix:
                counts.seen[slot, prefix] = 1.0

    def saved(self, ids: list[list[int]], positions: list[list[int]], last: int, context: int,
              uniform: list[float], sampling: list[list[float]], slot: int | None,
              targets: list[list[int]] | None = None, verify: bool = False) -> set[str] | None:
        """The compile-cache entries the step `run` takes with these inputs, when it would trace and
        compile nothing, else None (see `PrecompiledFunction.saved`); runs no graph."""
        with self._inputs(ids, positions, last, context, uniform, sampling, slot, targets, verify, None) as inputs:
            return self.step.saved(self.model, self.cache, *inputs)

    @contextlib.contextmanager
    def _inputs(self, ids: list[list[int]], positions: list[list[int]], last: int, context: int,
                uniform: list[float], sampling: list[list[float]], slot: int | None,
                targets: list[list[int]] | None, verify: bool, images: torch.Tensor | None
                ) -> Iterator[tuple[Any, ...]]:
        """Within: the step's inputs on the device (after the model and the cache), the cache's writes
        set for them and the model's attention packed; a vision-language model's prefill pieces as
        embeddings, with `images` (their placeholders' features) in their places."""
        device = self.model.device
        ids_tensor = torch.tensor(ids, device=device)
        embeds = None if self.images is None or slot is None else prompt_embeddings(self.model, ids_tensor, images)
        positions_tensor = torch.tensor(positions, device=device)
        writes = self.cache.writes
        writes.positions = positions_tensor
        writes.slot = None if slot is None else torch.tensor([slot], device=device)
        writes.context = context
        sampled = slot is not None or any(row[0] > 0 or row[PENALTIES] != NO_PENALTIES for row in sampling)
        if self.adapters is not None:  # (each row's adapter: the layers' hooks read it)
            self.adapters.rows.set([int(row[ADAPTER]) for row in sampling], self.model.dtype, device)
        try:
            with packed_attention(self.model):
                yield (ids_tensor, positions_tensor, torch.tensor([last], device=device),
                       torch.tensor([row[:ADAPTER] for row in sampling], device=device),  # (the adapter: above)
                       torch.tensor(uniform, dtype=torch.float32, device=device), sampled,
                       None if targets is None else torch.tensor(targets, device=device), verify, embeds)
        finally:  # (between steps the device holds the cache only)
            writes.positions = writes.slot = None
            if self.adapters is not None:
                self.adapters.rows.set(None, self.model.dtype, device)
