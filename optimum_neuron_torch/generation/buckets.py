"""The fixed set of shapes compiled generation runs: batch-size buckets, prompt-length buckets,
context-length buckets and one KV cache length."""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from transformers import PretrainedConfig

from ..errors import ConfigurationError

DEFAULT_BATCH_SIZES = (1, 2, 4, 8)
DEFAULT_MAX_LENGTH = 2048
SMALLEST_PROMPT_BUCKET = 16
# Default context buckets: the cache length, then a quarter of it, down to this size. Each one is a
# decode graph per batch size; a step attends over (and reads) its bucket's keys and values only.
SMALLEST_CONTEXT_BUCKET = 128
# The names configs give their context length (the longest sequence their positions cover), most common first.
CONTEXT_LENGTH_NAMES = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx",
                        "max_target_positions")


@dataclass(frozen=True)
class Buckets:
    """Every batch is padded to a batch size in `batch_sizes`; every prompt is left-padded to a
    length in `prompt_buckets`, or to a multiple of the largest one and prefilled in chunks of
    it; the KV cache holds `max_length` tokens (padded prompt plus new tokens). Each forward
    attends over the smallest of the `context_buckets` that holds the sequence so far (its keys
    and values only are read), so a short sequence costs what its length costs; `max_length` is
    always the last one. None: the default, `max_length` and its quarters down to 128."""

    batch_sizes: tuple[int, ...]
    prompt_buckets: tuple[int, ...]
    max_length: int
    context_buckets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.context_buckets is None:
            object.__setattr__(self, "context_buckets", default_context_buckets(self.max_length))
        for name in ("batch_sizes", "prompt_buckets", "context_buckets"):
            values = tuple(sorted(set(int(value) for value in getattr(self, name))))
            if not values or values[0] < 1:
                raise ConfigurationError(f"{name} must hold at least one positive size, got {getattr(self, name)!r}.")
            object.__setattr__(self, name, values)
        if self.prompt_buckets[-1] >= self.max_length:
            raise ConfigurationError(
                f"the largest prompt bucket ({self.prompt_buckets[-1]}) must be below max_length ({self.max_length}), "
                "to leave room for new tokens."
            )
        if self.context_buckets[-1] > self.max_length:
            raise ConfigurationError(f"context bucket {self.context_buckets[-1]} is above max_length "
                                     f"({self.max_length}), the length of the KV cache they are parts of.")
        if self.context_buckets[-1] != self.max_length:  # (the cache's whole length is always one)
            object.__setattr__(self, "context_buckets", (*self.context_buckets, self.max_length))

    @classmethod
    def default(cls, config: PretrainedConfig, max_length: int | None = None) -> Buckets:
        """Batch sizes 1, 2, 4, 8; prompt buckets 16, 64, 256, ... (x4) up to half the cache; a
        cache of the model's context length, capped at 2048; context buckets of the cache's length
        and its quarters down to 128 (see `default_context_buckets`)."""
        text_config = config.get_text_config(decoder=True)
        context = next((getattr(text_config, name) for name in CONTEXT_LENGTH_NAMES
                        if isinstance(getattr(text_config, name, None), int)), DEFAULT_MAX_LENGTH)
        max_length = max_length or min(context, DEFAULT_MAX_LENGTH)
        prompt_buckets = [min(SMALLEST_PROMPT_BUCKET, max_length // 2)]
        while prompt_buckets[-1] * 4 <= max_length // 2:
            prompt_buckets.append(prompt_buckets[-1] * 4)
        return cls(DEFAULT_BATCH_SIZES, tuple(prompt_buckets), max_length)

    @classmethod
    def for_slots(cls, config: PretrainedConfig, slots: int, max_length: int | None = None,
                  prompt_buckets: tuple[int, ...] | None = None) -> Buckets:
        """The default buckets (see `default`) of an engine of `slots` decode slots: batch sizes the
        powers of two below `slots`, and `slots`."""
        default = cls.default(config, max_length)
        powers_of_two = tuple(2**power for power in range(slots.bit_length()) if 2**power < slots)
        return cls((*powers_of_two, slots), prompt_buckets or default.prompt_buckets, default.max_length)

    def batch_size_for(self, batch_size: int) -> int | None:
        """The smallest batch bucket that holds `batch_size`, or None."""
        return next((size for size in self.batch_sizes if size >= batch_size), None)

    def prompt_shape_for(self, prompt_length: int) -> tuple[int, int]:
        """(padded length, chunk length): the smallest bucket that holds the prompt, else a
        multiple of the largest bucket, prefilled one chunk at a time."""
        for length in self.prompt_buckets:
            if length >= prompt_length:
                return length, length
        chunk = self.prompt_buckets[-1]
        return -(-prompt_length // chunk) * chunk, chunk

    def context_bucket_for(self, length: int) -> int:
        """The smallest context bucket that holds `length` tokens (`max_length` at most)."""
        return next((bucket for bucket in self.context_buckets if bucket >= length), self.max_length)

    @property
    def prompt_lengths(self) -> tuple[int, ...]:
        """Deprecated name of `prompt_buckets`."""
        warnings.warn("Buckets.prompt_lengths is deprecated: use Buckets.prompt_buckets.", FutureWarning, stacklevel=2)
        return self.prompt_buckets

    def to_dict(self) -> dict[str, Any]:
        return {name: list(value) if isinstance(value, tuple) else value for name, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Buckets:
        """Buckets from `to_dict()`'s output, also as saved before prompt buckets had one name
        (`prompt_lengths`, read with a warning)."""
        if "prompt_buckets" not in values and "prompt_lengths" in values:
            warnings.warn("these saved buckets name their prompt buckets `prompt_lengths`, "
                          "as development versions before "
                          "0.1.0.dev0 did: read as `prompt_buckets` (save the model again to update the file).",
                          FutureWarning, stacklevel=2)
            values = {**values, "prompt_buckets": values["prompt_lengths"]}
        context = values.get("context_buckets")  # (absent from folders saved before context buckets)
        return cls(tuple(values["batch_sizes"]), tuple(values["prompt_buckets"]), int(values["max_length"]),
                   tuple(context) if context is not None else None)


def default_context_buckets(max_length: int) -> tuple[int, ...]:
    """`max_length`, then a quarter of it, and so on while at least `SMALLEST_CONTEXT_BUCKET`:
    2048 -> (128, 512, 2048); a cache shorter than 512 is one bucket."""
    buckets = [max_length]
    while buckets[0] // 4 >= SMALLEST_CONTEXT_BUCKET:
        buckets.insert(0, buckets[0] // 4)
    return tuple(buckets)


@dataclass(frozen=True)
class PlannedGraph:
    """One graph compiled generation compiles: what it runs (`prefill`, `decode`, `chunk` of a long
    prompt, `sampling decode`, `encoder`), for how many rows, on how many new tokens per row, over
    how many cache positions (0: the encoder, which has no cache)."""

    role: str
    batch: int
    tokens: int
    context: int


def graph_plan(buckets: Buckets, *, encoder_decoder: bool = False, sampling: bool = False,
               chunks: bool = True, encoder_lengths: tuple[int, ...] | None = None) -> list[PlannedGraph]:
    """Every graph `precompile()` compiles for `buckets`, which are all the graphs generation meets
    (the compile bill, before anything compiles). Per batch bucket: a prefill per prompt bucket
    (over the context bucket that holds it), a decode step per context bucket, with several context
    buckets a chunk of a prompt longer than the largest prompt bucket in each context bucket such a
    prompt can meet (not for `chunks=False`: caches of state-space layers, prefilled whole), and
    with `sampling` a decode step that samples per context bucket. Encoder-decoders: per batch
    bucket and encoder length (`encoder_lengths`, default the prompt buckets; a speech model's
    one window), an encoder and a decode step over its cross-attention.

    Example:
        >>> len(graph_plan(Buckets((1, 4), (8, 16), 64)))  # per batch bucket: 2 prefills and a decode step
        6
    """
    plan = []
    for batch in buckets.batch_sizes:
        if encoder_decoder:
            for length in encoder_lengths or buckets.prompt_buckets:
                plan += [PlannedGraph("encoder", batch, length, 0), PlannedGraph("decode", batch, 1, length)]
            continue
        windows = len(buckets.context_buckets) > 1
        contexts = buckets.context_buckets if windows else (buckets.max_length,)
        plan += [PlannedGraph("prefill", batch, length, buckets.context_bucket_for(length) if windows
                              else buckets.max_length) for length in buckets.prompt_buckets]
        plan += [PlannedGraph("decode", batch, 1, context) for context in contexts]
        chunk = buckets.prompt_buckets[-1]
        if windows and chunks and 2 * chunk + 2 <= buckets.max_length:
            plan += [PlannedGraph("chunk", batch, chunk, context) for context in contexts
                     if context >= buckets.context_bucket_for(2 * chunk)]
        if sampling:
            plan += [PlannedGraph("sampling decode", batch, 1, context) for context in contexts]
    # A graph is its shapes: a chunk in the context of the largest prompt bucket's prefill is that prefill
    distinct: dict[tuple[int, int, int, bool], PlannedGraph] = {}
    for graph in plan:
        distinct.setdefault((graph.batch, graph.tokens, graph.context, graph.role == "sampling decode"), graph)
    return list(distinct.values())


def chunk_contexts(buckets: Buckets) -> tuple[int, ...]:
    """The context buckets the engine's chunks of a long prompt attend over, after the first (a
    graph each): a prompt longer than the largest prompt bucket (the chunk) is prefilled a chunk at
    a time, and a chunk after the first ends at a multiple of the chunk, or at `max_length`."""
    chunk, longest = buckets.prompt_buckets[-1], buckets.max_length - 1
    if longest <= chunk:
        return ()
    first = buckets.context_bucket_for(min(2 * chunk, buckets.max_length))
    return tuple(context for context in buckets.context_buckets if context >= first)


def engine_plan(buckets: Buckets, *, sampling: bool = True, scoring: bool = False,
                prefix_caching: bool = False, speculative_tokens: int = 0) -> list[PlannedGraph]:
    """Every graph the generation engine (`engine.GenerationEngine`) runs for `buckets`: a prefill of
    one prompt per prompt bucket (over the bucket), a chunk per `chunk_contexts`, per batch and
    context bucket a greedy decode step and, with `sampling`, one that samples; with `scoring`, a
    prefill and a chunk of each of those shapes that also scores every prompt token (see
    `slots.slot_step`); with `prefix_caching`, a `suffix` per prompt bucket and context bucket
    beyond it (the rest of a prompt after a prefix its slot holds, from any position: see
    `prefix_cache`), but those the chunks are; with `speculative_tokens` k, a `verify` of one row and
    k + 1 tokens per context bucket (see `speculation`).

    Example:
        >>> len(engine_plan(Buckets((1, 2), (8, 16), 64, (32, 64))))  # 2 prefills, 2 chunks, 2 x 2 x 2 decode steps
        12
    """
    plan = [PlannedGraph("prefill", 1, length, length) for length in buckets.prompt_buckets]
    plan += [PlannedGraph("chunk", 1, buckets.prompt_buckets[-1], context) for context in chunk_contexts(buckets)]
    for batch in buckets.batch_sizes:
        for context in buckets.context_buckets:
            plan.append(PlannedGraph("decode", batch, 1, context))
            if sampling:
                plan.append(PlannedGraph("sampling decode", batch, 1, context))
    if scoring:
        plan += [PlannedGraph(f"scoring {graph.role}", 1, graph.tokens, graph.context) for graph in plan
                 if graph.role in ("prefill", "chunk")]
    if prefix_caching:
        chunks = {(graph.tokens, graph.context) for graph in plan if graph.role == "chunk"}
        plan += [PlannedGraph("suffix", 1, tokens, context) for tokens in buckets.prompt_buckets
                 for context in buckets.context_buckets if context > tokens and (tokens, context) not in chunks]
    if speculative_tokens:
        plan += [PlannedGraph("verify", 1, speculative_tokens + 1, context) for context in buckets.context_buckets
                 if context > speculative_tokens + 1]
    return plan


def next_piece(buckets: Buckets, done: int, length: int, suffixes: bool = False) -> tuple[int, int, int]:
    """The next piece the generation engine prefills of a prompt of `length` tokens whose first
    `done` are in its slot: (first position, length, context), one of `engine_plan`'s graphs.

    A prompt that fits a prompt bucket is one piece, padded to it, attending over the bucket (its
    prefill graph); a longer one is cut in chunks of the largest bucket, the first over itself (the
    largest prefill's graph), the others over the smallest context bucket that holds them. With
    `suffixes` (prefix caching), a piece after the first position is the smallest prompt bucket
    that holds the rest (or a chunk), over the smallest context bucket that holds its end (a
    `suffix` graph). The last piece is moved back if it would pass `max_length`: it writes again
    some positions the one before wrote (the same tokens at the same positions), rather than padding
    beyond the cache.

    Example:
        >>> buckets = Buckets((1,), (16, 64), 256, (128, 256))
        >>> next_piece(buckets, 0, 40), next_piece(buckets, 0, 100), next_piece(buckets, 64, 100)
        ((0, 64, 64), (0, 64, 64), (64, 64, 128))
        >>> next_piece(buckets, 96, 100, suffixes=True), next_piece(buckets, 250, 254, suffixes=True)
        ((96, 16, 128), (240, 16, 256))
    """
    chunk = buckets.prompt_buckets[-1]
    if done == 0 and length <= chunk:
        bucket, _ = buckets.prompt_shape_for(length)
        return 0, bucket, bucket
    size = buckets.prompt_shape_for(length - done)[1] if suffixes and done else chunk
    start = min(done, buckets.max_length - size)
    return start, size, chunk if start == 0 else buckets.context_bucket_for(start + size)


def describe_plan(plan: list[PlannedGraph]) -> str:
    """One line: how many graphs, and how many of each role, e.g. `28 graphs: 16 prefill, 12 decode`."""
    counts = Counter(graph.role for graph in plan)
    return f"{len(plan)} graphs: " + ", ".join(f"{count} {role}" for role, count in counts.items())


def compile_bill(buckets: Buckets, plan: list[PlannedGraph], layers: int | None, layer_kinds: int = 1,
                 layer_reuse: bool = True, engine: bool = False) -> list[str]:
    """What compiled generation will compile for `buckets`, in lines for a person: the buckets, the
    graphs by role, and the programs the compiler gets from them (see `distinct_programs`).

    Args:
        buckets: the buckets.
        plan: their graphs (`graph_plan(buckets, ...)`).
        layers: the model's repeated decoder layers (None or 0: none).
        layer_kinds: how many distinct layers among them (layer classes).
        layer_reuse: whether each distinct layer is compiled once (`compiler.regions`), or every graph
            holds all its layers inline (`OPTIMUM_NEURON_TORCH_DISABLE_LAYER_REUSE=1`).
        engine: whether `plan` is the generation engine's (`engine_plan`).

    Returns:
        The lines.
    """
    lines = [f"buckets: batch sizes {list(buckets.batch_sizes)}, prompt buckets {list(buckets.prompt_buckets)}, "
             f"max length {buckets.max_length}, context buckets {list(buckets.context_buckets)}",
             f"graphs to compile: {describe_plan(plan)}"]
    if layers and layer_reuse:
        programs = distinct_programs(plan, layer_kinds, engine)
        lines.append(f"distinct programs after layer reuse: {programs} (each graph: the "
                     f"code before its {layers} decoder layers, {layer_kinds} layer program"
                     f"{'s' if layer_kinds > 1 else ''} called for all of them, the code after; graphs of the same "
                     "shapes share them)")
    elif layers:
        lines.append(f"distinct programs: {len(plan)} (each graph holds all {layers} decoder layers inline: "
                     "layer reuse is off)")
    return lines


def distinct_programs(plan: list[PlannedGraph], layer_kinds: int = 1, engine: bool = False) -> int:
    """How many programs the compiler gets from `plan` when each graph is compiled a layer at a time
    (`compiler.regions`): the code before the layers per distinct rows and new tokens (and, for a
    decode step, which builds the bounds of its keys there, per context bucket); one program per
    distinct layer per distinct rows, new tokens and context bucket; the code after (the final norm,
    the head, the sampler of a step that samples) per distinct rows and new tokens. Graphs that
    share shapes share programs (the compile cache's key is the code and its shapes), e.g. a step
    that samples shares all but its last program with the greedy one. The generation engine's steps
    (`engine`) build their masks from their context before the layers, and its prefills sample, so
    that its programs before the layers are per graph shapes and its programs after per rows, new
    tokens, whether they sample and whether they score the prompt (a scoring prefill shares every
    program before its head with the prefill of its shape).

    Example:
        >>> distinct_programs([PlannedGraph("decode", 1, 1, 128), PlannedGraph("decode", 1, 1, 512)])
        5
    """
    if engine:
        shapes = {(graph.batch, graph.tokens, graph.context) for graph in plan}
        # (a greedy decode step takes the argmax, a verify step every position's, the others sample)
        after = {(graph.role if graph.role in ("decode", "verify") else "sampling", graph.role.startswith("scoring"),
                  graph.batch, graph.tokens) for graph in plan}
        return len(shapes) * (1 + layer_kinds) + len(after)
    before = {(graph.role == "encoder", graph.batch, graph.tokens, graph.context if graph.tokens == 1 else None)
              for graph in plan}
    layers = {(graph.role == "encoder", graph.batch, graph.tokens, graph.context) for graph in plan}
    after = {(graph.role if graph.role in ("encoder", "sampling decode") else "logits", graph.batch, graph.tokens)
             for graph in plan}
    return len(before) + len(layers) * layer_kinds + len(after)
