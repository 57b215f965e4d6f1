"""What the static-graph path (`static_graphs`) serves: the shapes a call is padded to, or why it
cannot run on static graphs, and why a model cannot."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import GenerationMode
from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

from ..errors import NeuronTorchError, first_line
from .buckets import Buckets

SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
# Kwargs whose presence sends a call to Transformers' eager generate(), with why.
UNSUPPORTED_KWARGS = {
    "inputs_embeds": "generation from inputs_embeds",
    "cache": "a cache passed by the caller",
    "past_key_values": "a cache passed by the caller",
    "assistant_model": "assisted generation",
    "negative_prompt_ids": "negative prompts",
    "prefix_allowed_tokens_fn": "prefix_allowed_tokens_fn",
    "custom_generate": "custom_generate",
    "synced_gpus": "synced_gpus",
}

# The tensors an encoder-decoder's compiled call takes beside its input ids (any other is an input
# of its encoder, such as a vision-language model's images, which sends the call to eager generate()).
SEQ2SEQ_TENSORS = ("attention_mask", "decoder_input_ids", "decoder_attention_mask")


@dataclass(frozen=True)
class Shapes:
    """How one call is padded: real and bucketed rows, prompt length before and after padding,
    prefill chunk, new tokens."""

    rows: int
    batch: int
    prompt: int
    padded: int
    chunk: int
    new_tokens: int
    min_new_tokens: int


def plan(buckets: Buckets, input_ids: torch.Tensor | None, config: GenerationConfig, kwargs: dict[str, Any],
         encoder_decoder: bool, padded_prompts: bool, states_only: bool) -> Shapes | str:
    """The padded shapes of a call of `generate(input_ids, **kwargs)` with `config` on `buckets`, or
    why it cannot run on static graphs. The prompt is padded to a bucket if `padded_prompts` (see
    `why_padding_changes_outputs`), and prefilled in one chunk if `states_only` (see
    `static_cache.holds_states_only`)."""
    for name, why in UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            return why
    if input_ids is None or input_ids.ndim != 2:
        return "generation without a 2D tensor of input ids"
    if encoder_decoder:  # (the compiled encoder would run without the call's other encoder inputs)
        encoder_inputs = sorted(name for name, value in kwargs.items()
                                if isinstance(value, torch.Tensor) and name not in SEQ2SEQ_TENSORS)
        if encoder_inputs:
            return f"the encoder inputs {', '.join(encoder_inputs)} (the compiled encoder takes input ids only)"
    mode = config.get_generation_mode()
    if mode not in SUPPORTED_MODES:
        return f"{mode.value.replace('_', ' ')} (num_beams={config.num_beams})"
    if config.output_attentions or config.output_hidden_states:
        return "output_attentions / output_hidden_states"
    if config.cache_implementation not in (None, "static"):
        return f"cache_implementation={config.cache_implementation!r}"
    rows = input_ids.shape[0] * (config.num_return_sequences or 1)
    batch = buckets.batch_size_for(rows)
    if batch is None:
        return (f"a batch of {rows} sequences, above the largest batch bucket ({buckets.batch_sizes[-1]}); "
                "add a bucket with model.precompile(batch_sizes=...)")
    prompt = input_ids.shape[1]
    new_tokens = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt
    min_new_tokens = (config.min_new_tokens if config.min_new_tokens is not None
                      else max(config.min_length - prompt, 0))
    if encoder_decoder:
        padded = chunk = next((length for length in buckets.prompt_buckets if length >= prompt), 0)
        needed = new_tokens + 1
        if not padded:
            return (f"an encoder input of {prompt} tokens, above the largest prompt bucket "
                    f"({buckets.prompt_buckets[-1]}); add a bucket with model.precompile(prompt_buckets=...)")
    elif padded_prompts:
        padded, chunk = buckets.prompt_shape_for(prompt)
        needed = padded + new_tokens
    else:
        padded, chunk = prompt, min(prompt, buckets.prompt_buckets[-1])
        needed = padded + new_tokens
    if states_only and chunk < padded:
        return (f"a prompt of {prompt} tokens, above the largest prompt bucket "
                f"({buckets.prompt_buckets[-1]}), in a model whose cache holds state-space states only, "
                "which are prefilled in one chunk; add a bucket with model.precompile(prompt_buckets=...)")
    if needed > buckets.max_length:
        return (f"{needed} cache positions (prompt padded to {padded}, {new_tokens} new tokens) "
                "where the KV cache holds "
                f"{buckets.max_length}; raise it with model.precompile(max_length=...)")
    return Shapes(rows, batch, prompt, padded, chunk, new_tokens, min_new_tokens)


def speech_window(model: PreTrainedModel) -> int | None:
    """The encoder positions of the windows a speech encoder-decoder's own generate() encodes, or
    None for another model. Whisper's (`WhisperGenerationMixin`) cuts any audio into 30-second
    windows of `2 * max_source_positions` log-mel frames (a shorter clip is padded to one), so its
    encoder meets one shape per batch size, and its cross-attention `max_source_positions` keys."""
    return model.config.max_source_positions if isinstance(model, WhisperGenerationMixin) else None


def image_placeholder(model: PreTrainedModel) -> int | None:
    """The token that holds an image's place in the prompt of a vision-language model that merges
    its image features into its prompt's embeddings before its language model (`get_image_features`,
    `model.language_model`: LLaVA and the models built like it), or None for another model, and for
    the vision-language models whose language model needs more than the embeddings: image token
    types (Gemma 3, PaliGemma: images attend both ways), positions from the image grid (Qwen-VL), or
    an encoder and a decoder (Florence-2: the embeddings are its encoder's input, not a prompt to
    continue)."""
    config, inner = model.config, getattr(model, "model", None)
    if config.is_encoder_decoder:
        return None
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None or not hasattr(model, "get_image_features") or not hasattr(inner, "language_model"):
        return None
    if hasattr(inner, "get_rope_index") or {"token_type_ids", "mm_token_type_ids"} & set(
            inspect.signature(model.forward).parameters):
        return None
    return token


def plan_speech(buckets: Buckets, features: torch.Tensor | None, config: GenerationConfig,
                kwargs: dict[str, Any]) -> tuple[int, int] | str:
    """The rows of a speech encoder-decoder's generate() call (see `speech_window`) and the batch
    bucket they are filled to, or why it cannot run on static graphs."""
    for name, why in UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            return why
    if kwargs.get("encoder_outputs") is not None:
        return "encoder outputs passed by the caller"
    if features is None or features.ndim != 3:
        return "generation without a 3D tensor of input features ([batch, mel bins, frames])"
    mode = config.get_generation_mode()
    if mode not in (*SUPPORTED_MODES, GenerationMode.BEAM_SEARCH):  # (see `SpeechGraphs._compiled_call`)
        return f"{mode.value.replace('_', ' ')} (num_beams={config.num_beams})"
    if config.num_return_sequences not in (None, 1):
        return f"num_return_sequences={config.num_return_sequences}"
    rows = features.shape[0]
    batch = buckets.batch_size_for(rows)
    if batch is None:
        return (f"a batch of {rows} audio inputs, above the largest batch bucket ({buckets.batch_sizes[-1]}); "
                "add a bucket with model.precompile(batch_sizes=...)")
    return rows, batch


def why_no_static_cache(model: PreTrainedModel) -> tuple[str, str] | None:
    """Why a static cache cannot serve `model`, if its forward takes no `cache` (RWKV keeps a state
    of its own, OpenAI GPT and XLNet none that Transformers' cache classes hold): the reason, and
    what would make it compile. None for the others."""
    if "cache" in inspect.signature(model.forward).parameters:
        return None
    return (f"model type {model.config.model_type!r} (its forward takes no `cache`: the state it keeps between "
            "steps, if any, is not one Transformers' static cache holds)",
            "a forward that takes Transformers' `cache` argument")


def why_not_compiled(error: Exception, model: PreTrainedModel) -> tuple[str, str]:
    """What to tell the user when the compiled path of `model` failed with `error`: the reason,
    and what would make the model compile."""
    if isinstance(error, torch._dynamo.exc.BackendCompilerFailed):
        error = error.inner_exception  # (what the compile backend raised)
    if isinstance(error, torch._dynamo.exc.Unsupported):
        remedy = ("Dynamo cannot trace the model's code in one graph; `optimum-cli neuron-torch check` shows "
                  "where, and a model patch (optimum_neuron_torch.patches) can rewrite that code")
    elif isinstance(error, torch._dynamo.exc.UserError | GuardOnDataDependentSymNode):
        remedy = ("the model's code branches on, or sizes tensors by, tensor values; a model patch "
                  "(optimum_neuron_torch.patches) that keeps the shapes static would make it compile")
    elif isinstance(error, NeuronTorchError):
        remedy = ("a model patch (optimum_neuron_torch.patches) that replaces the ops named by ops the "
                  "compiler takes")
    else:
        remedy = ("the compiled path of this architecture needs a fix; `optimum-cli neuron-torch check` "
                  "shows the failing step")
    return (f"model type {model.config.model_type!r} (its compiled forward fails with {type(error).__name__}: "
            f"{first_line(error)[:300]})", remedy)


def why_padding_changes_outputs(model: PreTrainedModel) -> str | None:
    """Why left padding (masked pad tokens before the prompt) would change a decoder's outputs, or
    None: a forward without `position_ids` numbers positions by cache slot (learned or sinusoidal
    positions from the cache length, ALiBi without a mask). (Transformers' linear-attention and
    state-space layers zero the states of masked tokens, so padding leaves their states as they are.)"""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return "numbers positions by cache slot (its forward takes no position_ids)"
    return None
