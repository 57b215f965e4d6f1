"""Compiled generation on a loaded model: its class becomes a subclass of itself that adds
`precompile()` and routes `generate()` through compiled graphs. The model stays an instance of its
Transformers class under the same name; `disable_compiled_generation` restores the class."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import CompileConfig, GenerationConfig, PreTrainedModel
from transformers.generation import LogitsProcessorList
from transformers.masking_utils import create_masks_for_generate

from .buckets import Buckets
from .interval_masks import compact
from .native_ops import native_generation_ops
from .neuron_generation import NeuronGeneration
from .saving import restore, save
from .speech_graphs import SpeechGraphs
from .split_model import tensor_parallel_mesh


class NeuronGenerationMixin:
    """What compiled generation adds to a Transformers model class."""

    neuron_generation: NeuronGeneration

    def generate(
        self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, **kwargs: Any
    ) -> Any:
        """Transformers' `generate()`, run on compiled static-shape graphs (see
        `optimum_neuron_torch.generation`); its decoding ops run natively on the device."""
        with native_generation_ops():
            return self.neuron_generation.generate(super().generate, inputs, generation_config, **kwargs)

    def precompile(self, batch_sizes: tuple[int, ...] | None = None, prompt_buckets: tuple[int, ...] | None = None,
                   max_length: int | None = None, show_progress: bool = True,
                   context_buckets: tuple[int, ...] | None = None, sampling: bool | None = None) -> None:
        """Compiles every graph generation needs, for these buckets (kept for later calls and
        saved by `save_pretrained`); graphs already in the compile cache are loaded instead. A
        bucket set not given stays as it is, except context buckets, which follow a new
        `max_length` (see `Buckets`). With `sampling` (default: whether the model's generation
        config samples), the decode steps that sample in the graph are compiled too."""
        buckets = self._buckets_with(batch_sizes, prompt_buckets, max_length, context_buckets)
        self.neuron_generation.set_buckets(buckets)
        self.neuron_generation.precompile(show_progress, sampling)

    def compile_bill(self, batch_sizes: tuple[int, ...] | None = None, prompt_buckets: tuple[int, ...] | None = None,
                     max_length: int | None = None, context_buckets: tuple[int, ...] | None = None,
                     sampling: bool | None = None) -> list[str]:
        """What `precompile()` with these arguments would compile, in lines for a person: the
        buckets, the graphs by role and the programs the compiler gets from them (each distinct
        decoder layer compiled once per shape). Compiles nothing and changes nothing.

        Example:
            >>> print("\\n".join(model.compile_bill(batch_sizes=(1,))))  # doctest: +SKIP
            buckets: batch sizes [1], prompt buckets [16, 64, 256, 1024], max length 2048, context buckets [...]
            graphs to compile: 7 graphs: 4 prefill, 3 decode
            distinct programs after layer reuse: 19 (each graph: the code before its 30 decoder layers, ...)
        """
        buckets = self._buckets_with(batch_sizes, prompt_buckets, max_length, context_buckets)
        return self.neuron_generation.compile_bill(buckets, sampling)

    def _buckets_with(self, batch_sizes: tuple[int, ...] | None, prompt_buckets: tuple[int, ...] | None,
                      max_length: int | None, context_buckets: tuple[int, ...] | None) -> Buckets:
        """The model's buckets with those given replaced (context buckets follow a new max_length)."""
        current = self.neuron_generation.buckets
        max_length = max_length or current.max_length
        if context_buckets is None and max_length == current.max_length:
            context_buckets = current.context_buckets
        return Buckets(batch_sizes or current.batch_sizes, prompt_buckets or current.prompt_buckets, max_length,
                       context_buckets)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Transformers' (or the model's own), after giving the cache the context bucket of this
        forward (see `StaticGraphs.fit_context`), whose length sizes the attention mask, and
        with the cache's length told by the host (see `StaticGraphs.length_from_host`)."""
        generation = self.neuron_generation.static
        if not generation.active:
            return super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        cache = kwargs.get("cache")
        generation.fit_context(cache, input_ids, decoding=kwargs.get("next_sequence_length") == 1)
        with generation.length_from_host(cache, input_ids, kwargs):
            return super().prepare_inputs_for_generation(input_ids, *args, **kwargs)

    def create_masks_for_generate(self, *args: Any, **kwargs: Any) -> Any:
        """Transformers' masks of a step (the model's own function, or Transformers'), as intervals
        in the decode steps of compiled generation (see `interval_masks`): the bounds cross to the
        device, not the masks."""
        make_masks = getattr(super(), "create_masks_for_generate", create_masks_for_generate)
        masks = make_masks(*args, **kwargs)
        generation = self.neuron_generation.static
        # Decode steps only (prefill graphs also meet masks made on the device, see `forward`), of
        # decoders (an encoder-decoder's first decoder step runs eagerly, not through `forward`).
        decoding = getattr(kwargs.get("inputs_embeds"), "shape", (0, 0))[1] == 1
        return compact(masks) if generation.active and decoding and not generation.encoder_decoder else masks

    def _get_logits_processor(self, generation_config: GenerationConfig, *args: Any, **kwargs: Any
                              ) -> LogitsProcessorList:
        """Transformers' (or the model's own), shown to compiled generation, which lets the loop take
        the tokens the graph chose, greedy or sampled, when it would choose them itself (see
        `StaticGraphs.choose_tokens`, which gives the processors the loop runs)."""
        processors = super()._get_logits_processor(generation_config, *args, **kwargs)
        if self.neuron_generation.static.active:
            return self.neuron_generation.static.choose_tokens(processors, generation_config)
        return processors

    def get_encoder(self, *args: Any, **kwargs: Any) -> Any:
        """Transformers' (or the model's own); while a speech model's generate() runs compiled, the
        encoder it returns runs compiled (see `speech_graphs`)."""
        encoder = super().get_encoder(*args, **kwargs)
        generation = self.neuron_generation.static
        return generation.compiled_encoder(encoder) if generation.active and isinstance(generation, SpeechGraphs) \
            else encoder

    def _prepare_static_cache(self, cache_implementation: str, batch_size: int, max_cache_len: int,
                              *args: Any, **kwargs: Any) -> Any:
        """Transformers' (which a speech model's generate() asks for, see `speech_graphs`); while it
        runs compiled, the static cache of the call's batch bucket, of the buckets' length."""
        generation = self.neuron_generation.static
        if not (generation.active and isinstance(generation, SpeechGraphs)):
            return super()._prepare_static_cache(cache_implementation, batch_size, max_cache_len, *args, **kwargs)
        model_kwargs = kwargs.get("model_kwargs", args[-1] if args else {})
        return generation.cache_for(batch_size, model_kwargs["encoder_outputs"][0].shape[1], max_cache_len)

    def get_compiled_call(self, compile_config: CompileConfig | None) -> Callable[..., Any]:
        if self.neuron_generation.static.active:
            return self.neuron_generation.static.forward
        return super().get_compiled_call(compile_config)

    def save_pretrained(
        self, save_directory: str | os.PathLike[str], *args: Any, is_main_process: bool = True, **kwargs: Any
    ) -> None:
        """Transformers' `save_pretrained`, plus the buckets and the compiled graphs."""
        super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process or tensor_parallel_mesh(self) is not None:  # (each rank saves its own graphs)
            save(self.neuron_generation, Path(save_directory))


@functools.cache
def _with_compiled_generation(model_class: type[PreTrainedModel]) -> type[PreTrainedModel]:
    prepare = _signed_as(NeuronGenerationMixin.prepare_inputs_for_generation,
                         model_class.prepare_inputs_for_generation)
    return type(model_class.__name__, (NeuronGenerationMixin, model_class),
                {"__module__": model_class.__module__, "__qualname__": model_class.__qualname__,
                 "__doc__": model_class.__doc__, "prepare_inputs_for_generation": prepare})


def _signed_as(function: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """`function` under `original`'s signature: Transformers accepts the arguments of a generate() call
    that the model's `prepare_inputs_for_generation` names (Cohere ASR's takes the `audio_chunk_index`
    its processor gives), so the override keeps the model's signature."""

    @functools.wraps(function)
    def call(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
        return function(self, *args, **kwargs)

    call.__signature__ = inspect.signature(original)  # (read before `__wrapped__`)
    return call


def enable_compiled_generation(model: PreTrainedModel, buckets: Buckets | None = None,
                               saved: str | os.PathLike[str] | None = None) -> PreTrainedModel:
    """Routes `model.generate()` through compiled graphs of `buckets` (default: the buckets saved
    in the folder `saved`, else `Buckets.default`); graphs saved there join the compile cache."""
    if isinstance(model, NeuronGenerationMixin):
        disable_compiled_generation(model)
    restored = restore(Path(saved), model) if saved is not None else None
    model.neuron_generation = NeuronGeneration(model, buckets or restored or Buckets.default(model.config))
    model.__class__ = _with_compiled_generation(type(model))
    return model


def disable_compiled_generation(model: PreTrainedModel) -> PreTrainedModel:
    """Gives `model` back its own class and Transformers' `generate()`."""
    if isinstance(model, NeuronGenerationMixin):
        model.__class__ = type(model).__bases__[1]
        del model.neuron_generation
    return model
