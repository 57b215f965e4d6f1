"""generate() of speech encoder-decoders (Whisper) on static graphs: the static-graph path (see
`static_graphs`) for models whose own generate() feeds their encoder fixed windows of audio.

Whisper's generate() cuts any audio into 30-second windows of log-mel frames (a shorter clip is
padded to one window), handles timestamps, languages, prompts and temperature fallback, and calls
Transformers' generate() once per window. It runs unchanged here, on Transformers' static-cache
compile path (`cache_implementation="static"` and the `neuron` compile config), with three things
chosen by this module: the call's rows are filled to a batch bucket (with copies of the first row,
cut from the output afterwards); the encoder Transformers gets from `get_encoder()` runs compiled
(`CompiledEncoder`: one graph per batch bucket, since every window has the same shape); and the
static cache Transformers asks for (`_prepare_static_cache`) is the batch bucket's, of the buckets'
`max_length` positions, allocated once. The decoder's prompt (its start, language and task tokens)
runs eagerly, in one step; every decode step after it runs the compiled step of `StaticGraphs`
(one graph per batch bucket). So a speech model compiles two graphs per batch bucket, whatever the
audio's length. Beam search (the default of Transformers' speech recognition pipeline) runs its
encoder compiled, but its decode steps eagerly: Transformers' beam search calls the model itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import EncoderDecoderCache, GenerationConfig, PreTrainedModel
from transformers.generation import GenerationMode
from transformers.modeling_outputs import BaseModelOutput

from ..errors import DEVICE_OR_JOB_FAILURES, ConfigurationError
from .buckets import Buckets, PlannedGraph, graph_plan
from .compiling import COMPILE_CONFIG
from .padding import fill_batch, unpad_rows
from .static_graphs import StaticGraphs
from .static_plans import plan_speech, speech_window


class SpeechGraphs(StaticGraphs):
    """The static-graph generation state of a speech encoder-decoder (see the module's docstring)."""

    def __init__(self, model: PreTrainedModel, buckets: Buckets) -> None:
        super().__init__(model, buckets)
        self.window: int = speech_window(model)  # (the encoder positions of a window)

    def forward(self, **inputs: Any) -> Any:
        """A decode step (see `StaticGraphs.forward`), without the mask of the audio's frames that a
        long-form call hands every step: given the encoder's output, Whisper's forward does not
        read it, and its length (the audio's) would compile a step per audio length."""
        inputs.pop("attention_mask", None)
        return super().forward(**inputs)

    def compiled_encoder(self, encoder: torch.nn.Module) -> CompiledEncoder:
        """What `get_encoder()` gives Transformers' generate() while a call runs compiled."""
        return CompiledEncoder(self, encoder)

    def cache_for(self, batch: int, encoder_length: int, max_cache_len: int) -> EncoderDecoderCache:
        """The static cache Transformers' generate() asks for (`_prepare_static_cache`) while a call
        runs compiled: the batch bucket's, of the buckets' `max_length` positions, emptied.

        Raises:
            ConfigurationError: if the call needs more decoder positions than that.
        """
        if max_cache_len > self.buckets.max_length:
            raise ConfigurationError(f"this generate() call needs {max_cache_len} decoder positions where the "
                                     f"compiled cache holds {self.buckets.max_length}: raise it with "
                                     "model.precompile(max_length=...), or ask for fewer new tokens")
        return self._cache(batch, encoder_length)

    def _compiled_call(self, transformers_generate: Callable[..., Any], features: torch.Tensor | None,
                       generation_config: GenerationConfig | None, config: GenerationConfig,
                       eager_because: str | None, kwargs: dict[str, Any]) -> Any:
        """The model's own generate() on Transformers' static-cache compile path, its rows filled
        to a batch bucket, or eager if the buckets cannot serve it (see `static_plans.plan_speech`)."""
        shape = plan_speech(self.buckets, features, config, kwargs)
        if isinstance(shape, str) or eager_because is not None:
            self._warn_once(shape if isinstance(shape, str) else eager_because)
            return transformers_generate(features, generation_config, **kwargs)
        rows, batch = shape
        if config.get_generation_mode() == GenerationMode.BEAM_SEARCH:
            self._warn_beams(config.num_beams)
        call = {**kwargs, "cache_implementation": "static", "compile_config": COMPILE_CONFIG}
        if isinstance(call.get("attention_mask"), torch.Tensor):  # (of the frames, in long-form calls)
            call["attention_mask"] = fill_batch(call["attention_mask"], batch)
        try:
            with self._serving():
                output = transformers_generate(fill_batch(features, batch), generation_config, **call)
        except (*DEVICE_OR_JOB_FAILURES, ConfigurationError):
            raise  # (the device's or the job's state, or a call longer than the cache)
        except Exception as error:  # any failure of the compiled path: see `_degrade`
            return self._degrade(error, transformers_generate, features, generation_config, kwargs, None)
        return unpad_rows(output, rows, features.device)

    def _warn_beams(self, beams: int) -> None:
        message = (f"generate() with beam search (num_beams={beams}) runs its encoder compiled but its decode steps "
                   "eagerly: Transformers' beam search calls the model itself, not its compiled call. Greedy or "
                   "sampled generation (num_beams=1; e.g. the speech recognition pipeline's "
                   "generate_kwargs={'num_beams': 1}) compiles them.")
        self._warn(message, stacklevel=6)

    def graph_plan(self, buckets: Buckets | None = None, sampling: bool | None = None) -> list[PlannedGraph]:
        """Per batch bucket, the encoder of a window and a decode step (the decoder's prompt runs
        eagerly; decode steps that sample choose on the host, so `sampling` adds none)."""
        return graph_plan(buckets or self.buckets, encoder_decoder=True, encoder_lengths=(self.window,))

    def precompile(self, show_progress: bool = True, sampling: bool | None = None) -> None:
        """Compiles (or loads from the compile cache) the graphs of `graph_plan`, by generating 2
        tokens from a window of silence per batch bucket."""
        config = self.model.config
        for graph in tqdm([graph for graph in self.graph_plan() if graph.role == "encoder"],
                          desc="Compiling neuron graphs", disable=not show_progress):
            features = torch.zeros((graph.batch, config.num_mel_bins, 2 * graph.tokens), dtype=self.model.dtype,
                                   device=self.model.device)
            self.model.generate(features, max_new_tokens=2, min_new_tokens=2)


class CompiledEncoder:
    """A speech model's encoder as Transformers' generate() calls it (`get_encoder()`), run compiled
    by `SpeechGraphs`: its `forward` is the module's, whose signature Transformers reads."""

    def __init__(self, graphs: SpeechGraphs, encoder: torch.nn.Module) -> None:
        self.graphs, self.encoder, self.forward = graphs, encoder, encoder.forward

    def __call__(self, **inputs: Any) -> BaseModelOutput:
        inputs.pop("attention_mask", None)  # (of the whole audio's frames: Whisper's encoder does not read it)
        return self.graphs._encode(self.encoder, **inputs)
