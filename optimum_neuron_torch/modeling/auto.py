"""Neuron Auto classes: Transformers' Auto classes whose `from_pretrained` streams the weights
straight onto the `neuron` device and returns the plain Transformers model."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from ..fallbacks import apply_patches
from ..generation import enable_compiled_generation
from ..loading import load_pretrained


class _NeuronAutoMixin:
    """Replaces `from_pretrained` with the streaming loader; everything else is the Auto class's."""

    compiled_generation = False  # generate() through compiled graphs (see optimum_neuron_torch.generation)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike[str],
        *,
        revision: str | None = None,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str = "neuron",
        token: str | bool | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        local_files_only: bool = False,
        trust_remote_code: bool = False,
        patches: bool | Iterable[str] = True,
        **config_kwargs: Any,
    ) -> PreTrainedModel:
        """Loads the model for `pretrained_model_name_or_path` (a Hub id or a local folder) onto
        `device`, in eval mode. `dtype` defaults to the checkpoint's ("auto"). `patches` applies the
        model patches the architecture needs (True: all that apply; an iterable: those named among
        them; False: none), listed on `model.neuron_patches` (see optimum_neuron_torch.fallbacks).
        Other keyword arguments update the config, except `allow_pickle` (load `pytorch_model.bin`
        with `weights_only=True`), `ignore_mismatched_sizes` and `attn_implementation`."""
        model = load_pretrained(
            cls, pretrained_model_name_or_path, revision=revision, dtype=dtype, device=device, token=token,
            cache_dir=cache_dir, local_files_only=local_files_only, trust_remote_code=trust_remote_code,
            **config_kwargs,
        )
        apply_patches(model, None if patches is True else () if patches is False else patches)
        if cls.compiled_generation and model.device.type == "neuron":
            enable_compiled_generation(model, saved=model.neuron_checkpoint_folder)
        return model


class NeuronAutoModel(_NeuronAutoMixin, AutoModel):
    """The base model (hidden states), e.g. for feature extraction and sentence embeddings."""


class NeuronAutoModelForCausalLM(_NeuronAutoMixin, AutoModelForCausalLM):
    """Decoder language models (Llama, Mistral, Qwen2, Gemma2, GPT-2, ...), with compiled generation."""

    compiled_generation = True


class NeuronAutoModelForSeq2SeqLM(_NeuronAutoMixin, AutoModelForSeq2SeqLM):
    """Encoder-decoder language models (T5, BART, ...), with compiled generation."""

    compiled_generation = True


class NeuronAutoModelForMaskedLM(_NeuronAutoMixin, AutoModelForMaskedLM):
    """Masked language models (BERT, RoBERTa, ...)."""


class NeuronAutoModelForSequenceClassification(_NeuronAutoMixin, AutoModelForSequenceClassification):
    """Models with a sequence classification head."""


class NeuronAutoModelForTokenClassification(_NeuronAutoMixin, AutoModelForTokenClassification):
    """Models with a token classification head."""


class NeuronAutoModelForQuestionAnswering(_NeuronAutoMixin, AutoModelForQuestionAnswering):
    """Models with an extractive question answering head."""


HEAD_CLASSES = (
    NeuronAutoModelForCausalLM,
    NeuronAutoModelForSeq2SeqLM,
    NeuronAutoModelForMaskedLM,
    NeuronAutoModelForSequenceClassification,
    NeuronAutoModelForTokenClassification,
    NeuronAutoModelForQuestionAnswering,
)


def neuron_auto_class_for(config: PretrainedConfig) -> type:
    """The Neuron Auto class whose Transformers mapping gives the checkpoint's architecture
    (`config.architectures`), e.g. `NeuronAutoModelForCausalLM` for `GPT2LMHeadModel`; else
    `NeuronAutoModel` (the base model)."""
    architectures = set(config.architectures or ())
    for auto_class in HEAD_CLASSES:
        mapping = auto_class._model_mapping
        if type(config) in mapping and mapping[type(config)].__name__ in architectures:
            return auto_class
    return NeuronAutoModel
