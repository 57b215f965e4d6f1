"""generate() on Transformers' own loop over static-shape compiled graphs: the path of what the
generation engine does not serve (see `neuron_generation`): encoder-decoders, decoders whose cache
holds state-space or linear-attention states or that number positions by cache slot, and a model
whose engine failed. It goes once the engine's slots hold those.

Transformers' `generate()` runs the loop (logits processors, sampling, stopping criteria,
streamers, output classes); this module only chooses its shapes. Every call is padded to a batch
bucket and a prompt bucket (see `static_plans`) and given one static KV cache of fixed length per
batch bucket (see `static_cache`), and every forward of the loop goes through one compiled
function: prefill as Transformers' chunked prefill with the bucket as chunk size, then one decode
step at a time, each attending over the smallest context bucket of the cache that holds the
sequence so far (see `context_windows`). So the graphs are one per (batch bucket, prompt bucket)
plus one decode graph per (batch bucket, context bucket) (and one more, that samples, where calls
sample in the graph), whatever the prompt length or `max_new_tokens`. A decode step moves its
inputs (the token, its position, the bounds of its masks' intervals) and the token the graph chose
between host and device, not masks and logits (see `forward`). (Decoders that number positions by
cache slot, whose outputs left padding would change, keep their prompts' lengths: each prompt
length compiles a prefill graph of its own.) Encoder-decoders run a compiled encoder per (batch,
prompt bucket) and a compiled decode step per (batch, prompt bucket); their first decoder step
(one token, which fills the cross-attention cache) runs eagerly, because Transformers' chunked
prefill, the path that would compile it, slices the encoder's attention mask as if it were the
decoder's. What it cannot serve this way runs Transformers' eager `generate()`, with a warning
once per reason; so does, from its first call on, a model whose compiled path fails (`_degrade`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import EncoderDecoderCache, GenerationConfig, PreTrainedModel, StaticCache
from transformers.generation import LogitsProcessor, LogitsProcessorList, StoppingCriteriaList
from transformers.masking_utils import create_masks_for_generate
from transformers.modeling_outputs import BaseModelOutput

from ..compiler import regions
from ..compiler.dynamo_backend import recording_cache_keys
from ..errors import DEVICE_OR_JOB_FAILURES
from .buckets import Buckets, PlannedGraph, graph_plan
from .compiling import COMPILE_CONFIG, QUIET_WHILE_TRACED, call_module, dense, generation_step
from .context_windows import ContextWindows
from .interval_masks import for_graph
from .padding import (
    PaddingRowsDone,
    UnpaddedStreamer,
    default_attention_mask,
    fill_rows,
    pad_prompt,
    pad_token_id,
    prompt_streamed,
    unpad,
)
from .sampling import SamplingParameters
from .split_model import (
    embeddings_without_padding_index,
    share_random_state,
    tensor_parallel_mesh,
    whole_graphs_reason,
)
from .static_cache import CacheLength, allocate, holds_states_only, sizes_by_cache_length
from .static_plans import Shapes, plan, why_no_static_cache, why_not_compiled, why_padding_changes_outputs


class StaticGraphs:
    """The static-graph generation state of one model: its buckets, one static cache per batch
    bucket (and encoder bucket, for encoder-decoders), and the compiled forward every step goes through."""

    def __init__(self, model: PreTrainedModel, buckets: Buckets) -> None:
        self._model = weakref.ref(model)  # the model holds this object: no cycle, so it frees on `del`
        self.encoder_decoder: bool = model.config.is_encoder_decoder
        # Why left padding would change this decoder's outputs, if it would (see `static_plans`).
        self.unpadded_prompts: str | None = None if self.encoder_decoder else why_padding_changes_outputs(model)
        # Why this model cannot generate compiled and what would change it, known from its forward's
        # signature or once a call found out.
        self.unservable: tuple[str, str] | None = why_no_static_cache(model)
        self.buckets = buckets
        self.cache_keys: set[str] = set()  # compile-cache entries of this path's graphs
        self.active = False  # inside a compiled generate(): get_compiled_call() answers with `forward`
        self._caches: dict[tuple[int, int], StaticCache | EncoderDecoderCache] = {}
        self._windows: dict[tuple[int, int], ContextWindows] = {}  # the caches with context buckets
        self._prompt_length = 0  # the padded prompt of the call running
        self._context_floors = (0, 0)  # precompile(): the smallest context of (prefill, decode) steps
        self._compiled_forward: Callable[..., Any] | None = None
        self._compiled_encoder: Callable[..., Any] | None = None
        # How the call running takes the tokens the graph chose (see `choose_tokens`): each greedy
        # token, or, with the sampling parameters on the device, each sampled token of a decode step.
        self.tokens_from_graph = False
        self.sampling: SamplingParameters | None = None
        self._sampling_rows: torch.Tensor | None = None  # (its tensor on the device, made once a call)
        self.chose_in_graph = False  # whether the step just run chose its tokens in the graph
        self._warned: set[str] = set()
        # Whether the cache's length reaches the model's code as a scalar rather than a tensor (see
        # `static_cache.allocate`): set when a call found its tensor sizing the model's tensors.
        self.cache_length_as_scalar = False
        # One call at a time: the caches, the call's shapes and sampling rows above are this object's,
        # so a second thread's generate() waits for the first.
        self._one_call = threading.RLock()

    @functools.cached_property
    def states_only(self) -> bool:
        """Whether the model's cache holds state-space states only (`static_cache.holds_states_only`)."""
        return holds_states_only(self.model)

    @property
    def graph_budget(self) -> int:
        """The most graphs this bucket set can need (Dynamo's recompile limit is raised to it): per
        batch bucket, a prefill per prompt bucket and, per context bucket, a decode step, a decode
        step that samples and a prefill chunk of a prompt longer than the largest bucket; for
        encoder-decoders, an encoder and a decode step per encoder bucket, and a decode step."""
        buckets = self.buckets
        if self.encoder_decoder:
            return len(buckets.batch_sizes) * (len(buckets.prompt_buckets) * 2 + 1)
        return len(buckets.batch_sizes) * (len(buckets.prompt_buckets) + 3 * len(buckets.context_buckets))

    @property
    def model(self) -> PreTrainedModel:
        return self._model()

    @property
    def _vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    def set_buckets(self, buckets: Buckets) -> None:
        if (buckets.max_length, buckets.context_buckets) != (self.buckets.max_length, self.buckets.context_buckets):
            self._release_caches()
        self.buckets = buckets

    def _release_caches(self) -> None:
        self._caches.clear()
        self._windows.clear()

    # The compiled functions -------------------------------------------------------------------
    def forward(self, **inputs: Any) -> Any:
        """The model's forward, compiled. Its inputs are made canonical, so that each bucket meets
        one graph: standard strides (a chunk sliced from a longer prompt has others), and always a
        materialized attention mask (Transformers leaves it out of a prefill without padding), except
        for caches of state-space layers only, which Transformers gives no mask after the prompt.

        A decode step's masks arrive as intervals (see `interval_masks`), which the graph expands.
        The graph also chooses the token of each row: the greedy one, or, in a decode step of a call
        that samples in the graph, one drawn from a uniform number the host draws. When the call
        running takes it (see `choose_tokens`), only those tokens cross to the host, and the output's
        logits are a host row that makes Transformers' loop choose them: 0 at the token, -inf
        elsewhere."""
        if self._compiled_forward is None:
            self._compiled_forward = regions.compile_by_layer(
                generation_step, whole_because=whole_graphs_reason(self.model), **COMPILE_CONFIG.to_dict())
        tokens = inputs.get("input_ids")  # (a decoder's: an encoder-decoder's decoder takes decoder_input_ids)
        if tokens is None and "inputs_embeds" in inputs:  # (a prefill of embeddings, see `vision_graphs`)
            tokens = inputs["inputs_embeds"][..., 0]
        if inputs.get("attention_mask") is None and not self.encoder_decoder and not self.states_only:
            inputs["attention_mask"] = self._causal_mask(tokens, inputs["cache"], inputs.get("position_ids"))
        if "attention_mask" in inputs:
            inputs["attention_mask"] = for_graph(inputs["attention_mask"], self.model.device)
        inputs = {name: dense(value) for name, value in inputs.items()}
        sampled = self.sampling is not None and tokens.shape[-1] == 1  # (decoders' decode steps)
        if sampled:  # (the host draws the uniform numbers: from torch's generator, as multinomial would)
            rows = tokens.shape[0]
            if self._sampling_rows is None:
                self._sampling_rows = self.sampling.rows(rows).to(self.model.device)
            inputs["sampling"] = (self._sampling_rows, torch.rand(rows).to(self.model.device))
        output, tokens = self._compiled_forward(self.model, **inputs)
        self.chose_in_graph = self.tokens_from_graph or sampled
        if self.chose_in_graph:
            output.logits = self._logits_choosing(tokens.cpu(), output.logits.shape[-1])
        return output

    def choose_tokens(self, processors: LogitsProcessorList, config: GenerationConfig) -> LogitsProcessorList:
        """Called with the logits processors Transformers built for the call running: whether the
        loop takes the tokens the graph chose rather than the logits, and the processors it runs.
        It takes the greedy tokens when it would choose them itself from the logits unchanged
        (greedy search, no processor), and the tokens each decode step samples when the processors
        are warpers the graph applies (see `sampling`); never when scores or logits are returned.
        A sampled call's processors then pass the rows of the steps that chose in the graph as
        they are (the prefill's logits are warped on the host)."""
        returned = config.return_dict_in_generate and (config.output_scores or config.output_logits)
        self.tokens_from_graph = not config.do_sample and len(processors) == 0 and not returned
        in_graph = config.do_sample and not returned and not self.encoder_decoder
        self.sampling = SamplingParameters.of(processors) if in_graph else None
        if self.sampling is None:
            return processors
        return LogitsProcessorList([_UnlessChosenInGraph(self, processors)])

    @staticmethod
    def _logits_choosing(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Host logits [rows, 1, vocab] of -inf with 0 at each row's token, which argmax chooses."""
        logits = torch.full((tokens.shape[0], 1, vocab_size), float("-inf"))
        return logits.scatter_(2, tokens[:, None, None], 0.0)

    def _causal_mask(self, input_ids: torch.Tensor, cache: StaticCache, position_ids: torch.Tensor | None) -> Any:
        """The masks Transformers' generate() builds for a compiled forward, for a sequence without
        padding (`input_ids`: its tokens, or a tensor of their shape). The 2D mask covers the cache
        (its context bucket): its "future" slots, masked by causality anyway, are ones, which keeps
        Transformers from skipping the mask in favour of SDPA's `is_causal`."""
        model = self.model
        make_masks = getattr(model, "create_masks_for_generate", create_masks_for_generate)
        batch, length = input_ids.shape
        windows = self._windows_of(cache)
        width = windows.length if windows is not None else self.buckets.max_length
        return make_masks(
            config=model.config,
            inputs_embeds=torch.empty((batch, length, 0), dtype=model.dtype, device=input_ids.device),
            attention_mask=torch.ones((batch, width), dtype=torch.long, device=input_ids.device),
            cache=cache,
            position_ids=position_ids,
        )

    def _encode(self, encoder: torch.nn.Module, **inputs: Any) -> BaseModelOutput:
        """`encoder`'s output for `inputs`, compiled (a graph per shape)."""
        if self._compiled_encoder is None:
            self._compiled_encoder = regions.compile_by_layer(
                call_module, whole_because=whole_graphs_reason(self.model), **COMPILE_CONFIG.to_dict())
        return self._compiled_encoder(encoder, **{**inputs, "return_dict": True})

    def _cache(self, batch: int, encoder_length: int) -> StaticCache | EncoderDecoderCache:
        """The static cache of a batch bucket (and encoder bucket), allocated once (see
        `static_cache.allocate`), emptied per call."""
        key = (batch, encoder_length)
        if key not in self._caches:
            cache = allocate(self.model, self.buckets.max_length, batch,
                             encoder_length if self.encoder_decoder else None, self.cache_length_as_scalar,
                             self.states_only)
            self._caches[key] = cache
            if (not self.encoder_decoder and len(self.buckets.context_buckets) > 1
                    and ContextWindows.fit_for(cache)):
                self._windows[key] = ContextWindows(cache, self.buckets.context_buckets)
        cache = self._caches[key]
        if key in self._windows:
            self._windows[key].use(self.buckets.max_length)  # (reset below zeroes the whole cache)
        cache.reset()
        return cache

    def _windows_of(self, cache: Any) -> ContextWindows | None:
        return next((windows for windows in self._windows.values() if windows.cache is cache), None)

    def fit_context(self, cache: Any, input_ids: torch.Tensor, decoding: bool) -> None:
        """Before Transformers prepares a forward's inputs (which sizes the attention mask by the
        cache): gives a cache with context buckets the smallest bucket that holds the sequence after
        this forward. A decode step gets the whole sequence so far (on the host); every prefill
        chunk holds the padded prompt's bucket, so that a chunk's graph does not depend on its place."""
        windows = self._windows_of(cache)
        if windows is not None:
            prefill_floor, decode_floor = self._context_floors
            length = max(input_ids.shape[-1], decode_floor) if decoding else max(self._prompt_length, prefill_floor)
            windows.use(self.buckets.context_bucket_for(length))

    @contextlib.contextmanager
    def length_from_host(self, cache: Any, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> Iterator[None]:
        """While Transformers prepares a forward's inputs on the host (its arguments `input_ids` and
        `kwargs`): the cache answers its length from the host, rather than from the device. The
        host's 2D attention mask covers the tokens cached and those this forward feeds (the last
        `next_sequence_length`, else all of `input_ids`), as Transformers' own masks assume; without
        a mask (no padding), a decode step's `input_ids` are the whole sequence."""
        length = getattr(cache, "get_seq_length", None)
        mask, fed = kwargs.get("attention_mask"), kwargs.get("next_sequence_length")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.device.type == "cpu":
            known = mask.shape[-1] - (input_ids.shape[-1] if fed is None else fed)
        elif mask is None and fed is not None and input_ids.device.type == "cpu":
            known = input_ids.shape[-1] - fed
        else:
            known = None
        if not isinstance(length, CacheLength) or known is None:
            yield
            return
        length.on_host = known
        try:
            yield
        finally:
            length.on_host = None

    # generate() ---------------------------------------------------------------------------------
    def generate(self, transformers_generate: Callable[..., Any], inputs: torch.Tensor | None,
                 generation_config: GenerationConfig | None, eager_because: str | None = None, **kwargs: Any) -> Any:
        """Transformers' `generate()` (`transformers_generate`) on bucketed shapes and compiled graphs,
        or unchanged (eager) for what those cannot serve, or, given `eager_because` (why the engine
        of a model it serves refused the call), eagerly wherever it would compile: such a model
        compiles the engine's graphs only. Calls from several threads run one after the other."""
        with self._one_call:
            return self._generate(transformers_generate, inputs, generation_config, eager_because, **kwargs)

    def _generate(self, transformers_generate: Callable[..., Any], inputs: torch.Tensor | None,
                  generation_config: GenerationConfig | None, eager_because: str | None, **kwargs: Any) -> Any:
        input_ids = inputs if inputs is not None else kwargs.pop(self.model.main_input_name, None)
        config, _ = self.model._prepare_generation_config(generation_config, **kwargs)
        mesh = tensor_parallel_mesh(self.model)
        if mesh is not None and config.do_sample:
            share_random_state(mesh)
        if config.disable_compile:
            return transformers_generate(input_ids, generation_config, **kwargs)
        if self.unservable is not None:  # known from the start, or an earlier call found out
            self._warn_once(*self.unservable)
            return transformers_generate(input_ids, generation_config, **kwargs)
        return self._compiled_call(transformers_generate, input_ids, generation_config, config, eager_because, kwargs)

    def _compiled_call(self, transformers_generate: Callable[..., Any], input_ids: torch.Tensor | None,
                       generation_config: GenerationConfig | None, config: GenerationConfig,
                       eager_because: str | None, kwargs: dict[str, Any]) -> Any:
        """The call on the buckets' shapes (see `static_plans.plan`), or eager if they cannot serve it."""
        shapes = plan(self.buckets, input_ids, config, kwargs, self.encoder_decoder,
                      padded_prompts=self.unpadded_prompts is None, states_only=self.states_only)
        if self.unpadded_prompts is not None and not isinstance(shapes, str):
            self._note_unpadded_prompts()
        if isinstance(shapes, str) or eager_because is not None:
            self._warn_once(shapes if isinstance(shapes, str) else eager_because)
            return transformers_generate(input_ids, generation_config, **kwargs)
        call_kwargs: dict[str, Any] = {}
        self._prompt_length = shapes.padded
        try:
            call_kwargs = self._padded_call(input_ids, config, shapes, kwargs)
            with self._serving():
                output = transformers_generate(generation_config=generation_config, **call_kwargs)
        except DEVICE_OR_JOB_FAILURES:
            raise  # the device's or the job's state, not the model's: eager generation would not do better
        except Exception as error:  # any failure of the compiled path: see `_degrade`
            streamer = call_kwargs.get("streamer")
            if not self.cache_length_as_scalar and sizes_by_cache_length(error):
                self.cache_length_as_scalar = True  # (see `_scalar_cache_length`) and once more
                self._release_caches()
                return self.generate(transformers_generate, input_ids, generation_config,
                                     **prompt_streamed(kwargs, streamer))
            return self._degrade(error, transformers_generate, input_ids, generation_config, kwargs, streamer)
        columns = 0 if self.encoder_decoder else shapes.padded - shapes.prompt
        return unpad(output, shapes.rows, columns, input_ids.device)

    def _degrade(self, error: Exception, transformers_generate: Callable[..., Any], input_ids: torch.Tensor | None,
                 generation_config: GenerationConfig | None, kwargs: dict[str, Any],
                 streamer: UnpaddedStreamer | None) -> Any:
        """After the compiled path failed with `error`: the same call through Transformers' eager
        generate(). If that fails too, the error is the call's own (a bad input) and is raised as
        eager generation raises it; if it succeeds, the model cannot generate compiled, and does
        so eagerly from now on, with one warning that says why and what would change it."""
        self._release_caches()  # (device memory)
        output = transformers_generate(input_ids, generation_config, **prompt_streamed(kwargs, streamer))
        self.unservable = why_not_compiled(error, self.model)
        self._warn_once(*self.unservable)
        return output

    def _padded_call(self, input_ids: torch.Tensor, config: GenerationConfig, shapes: Shapes,
                     kwargs: dict[str, Any]) -> dict[str, Any]:
        """The arguments of Transformers' generate() for the padded call."""
        kwargs = {name: value for name, value in kwargs.items() if name not in ("max_length", "min_length")}
        attention_mask = kwargs.pop("attention_mask", None)
        if attention_mask is None:
            attention_mask = default_attention_mask(input_ids, config)
        # The loop's bookkeeping (logits processors, token selection, stopping) stays on the host:
        # Transformers moves only the model inputs to the device, and the logits back, each step.
        input_ids, attention_mask = input_ids.cpu(), attention_mask.cpu()
        if config.num_return_sequences and config.num_return_sequences > 1:
            input_ids = input_ids.repeat_interleave(config.num_return_sequences, dim=0)
            attention_mask = attention_mask.repeat_interleave(config.num_return_sequences, dim=0)
        if shapes.batch > shapes.rows:
            input_ids, attention_mask = fill_rows(input_ids, attention_mask, shapes.batch)
            stopping = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
            kwargs["stopping_criteria"] = StoppingCriteriaList([*stopping, PaddingRowsDone(shapes.rows)])
        pad_id = pad_token_id(config, self._vocab_size)
        input_ids, attention_mask = pad_prompt(input_ids, attention_mask, shapes.padded, pad_id,
                                               left=not self.encoder_decoder)
        if self.encoder_decoder:
            kwargs["encoder_outputs"] = self._encode(self.model.get_encoder(),
                                                     input_ids=input_ids.to(self.model.device),
                                                     attention_mask=attention_mask.to(self.model.device))
        else:
            kwargs["prefill_chunk_size"] = shapes.chunk
            if kwargs.get("streamer") is not None:
                kwargs["streamer"] = UnpaddedStreamer(kwargs["streamer"], shapes.padded - shapes.prompt)
        return {
            **kwargs,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "cache": self._cache(shapes.batch, shapes.padded if self.encoder_decoder else 0),
            "max_new_tokens": shapes.new_tokens,
            # (a min_new_tokens of 0, or a min_length within the prompt, would make Transformers add
            # a processor that holds EOS back until the padded prompt's length: it changes nothing,
            # but keeps the loop from taking the graph's tokens, see `choose_tokens`)
            **({"min_new_tokens": shapes.min_new_tokens} if shapes.min_new_tokens
               else {"min_new_tokens": None, "min_length": 0}),
            "num_return_sequences": 1,
            "cache_implementation": None,
            "compile_config": COMPILE_CONFIG,
        }

    @contextlib.contextmanager
    def _serving(self) -> Iterator[None]:
        """While Transformers' generate() runs: its compiled call is ours, Dynamo may keep a graph
        per bucket and traces logging calls as nothing (a model's `logger.warning_once` in forward
        would otherwise break the graph), the cache keys of the graphs used are recorded, and a
        split embedding has no padding index (see `embeddings_without_padding_index`)."""
        self.active = True
        try:
            with torch._dynamo.config.patch(recompile_limit=max(64, self.graph_budget),
                                            accumulated_recompile_limit=max(256, self.graph_budget),
                                            ignore_logging_functions=QUIET_WHILE_TRACED,
                                            capture_scalar_outputs=self.cache_length_as_scalar), \
                    recording_cache_keys() as keys, embeddings_without_padding_index(self.model):
                yield
        finally:
            self.active = self.tokens_from_graph = self.chose_in_graph = False
            self.sampling = self._sampling_rows = None
            self.cache_keys |= keys

    def _note_unpadded_prompts(self) -> None:
        message = (f"model type {self.model.config.model_type!r} {self.unpadded_prompts}, so padding a prompt to "
                   "a bucket would change its outputs: prompts are not padded, and each new prompt length compiles "
                   "a prefill graph of its own.")
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=5)

    def _warn_once(self, reason: str, remedy: str | None = None) -> None:
        self._warn(f"generate() with {reason} does not run on the compiled neuron graphs: falling back to "
                   "Transformers' eager generate(), which compiles nothing and is much slower on Neuron."
                   + (f" What would make it compile: {remedy}." if remedy else ""), stacklevel=4)

    def _warn(self, message: str, stacklevel: int) -> None:
        """Warns `message` the first time only (`stacklevel`: as seen from the caller)."""
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=stacklevel + 1)

    # precompile() ------------------------------------------------------------------------------
    def graph_plan(self, buckets: Buckets | None = None, sampling: bool | None = None) -> list[PlannedGraph]:
        """The graphs `precompile(sampling=sampling)` compiles for `buckets` (default: the model's);
        see `buckets.graph_plan`."""
        sampling = self.model.generation_config.do_sample if sampling is None else sampling
        return graph_plan(buckets or self.buckets, encoder_decoder=self.encoder_decoder, sampling=sampling,
                          chunks=not self.states_only)

    def precompile(self, show_progress: bool = True, sampling: bool | None = None) -> None:
        """Compiles (or loads from the compile cache) every graph of `graph_plan(sampling=sampling)`
        by running `generate()` once per graph with 2 new tokens: a prompt of each prompt bucket
        (its prefill; without context buckets also the decode step), a short prompt whose decode
        steps are held to each context bucket, a prompt of two chunks held to each context bucket a
        chunk needs, and a short prompt sampling in each context bucket (see `sampling`)."""
        buckets = self.buckets
        windows = not self.encoder_decoder and len(buckets.context_buckets) > 1
        shortest = buckets.prompt_buckets[0]
        runs = []  # (batch, prompt length, context floors of (prefill, decode), sampled)
        for graph in self.graph_plan(sampling=sampling):
            if graph.role in ("prefill", "encoder"):
                runs.append((graph.batch, graph.tokens, (0, 0), False))
            elif graph.role == "chunk":
                runs.append((graph.batch, 2 * graph.tokens, (graph.context, 0), False))
            elif graph.role == "decode" and windows:  # (else the prefills' runs decode in the one context)
                runs.append((graph.batch, shortest, (0, graph.context), False))
            elif graph.role == "sampling decode":
                runs.append((graph.batch, shortest, (0, graph.context if windows else 0), True))
        token = pad_token_id(self.model.generation_config, self._vocab_size)
        with self._one_call:  # (the floors below hold for these calls only)
            for batch, length, floors, sampled in tqdm(runs, desc="Compiling neuron graphs",
                                                       disable=not show_progress):
                ids = torch.full((batch, length), token, dtype=torch.long, device=self.model.device)
                # (2 new tokens: the prefill's and a decode step's; a sampled run cannot stop at EOS)
                settings = (dict(do_sample=True, eos_token_id=None) if sampled
                            else dict(do_sample=False, min_new_tokens=2))
                self._context_floors = floors
                try:
                    self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, **settings)
                finally:
                    self._context_floors = (0, 0)


class _UnlessChosenInGraph(LogitsProcessor):
    """Transformers' warpers of a call whose decode steps sample in the graph: they warp the logits
    of the steps that did not (the prefill's), and pass the host rows of those that did."""

    def __init__(self, generation: StaticGraphs, processors: LogitsProcessorList) -> None:
        self.generation, self.processors = generation, processors

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return scores if self.generation.chose_in_graph else self.processors(input_ids, scores)
