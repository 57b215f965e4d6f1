"""The generative model a command runs: the Neuron Auto class its config calls for."""

from __future__ import annotations

import os

from transformers import AutoConfig, PreTrainedModel

from ..loading import resolve_checkpoint
from ..modeling import (
    NeuronAutoModelForCausalLM,
    NeuronAutoModelForImageTextToText,
    NeuronAutoModelForSeq2SeqLM,
    neuron_auto_class_for,
)


def load_generative_model(name_or_path: str | os.PathLike[str], tp_size: int = 1,
                          dtype: str | None = None) -> PreTrainedModel:
    """The model on the device, with compiled generation: `NeuronAutoModelForSeq2SeqLM` for an
    encoder-decoder, `NeuronAutoModelForImageTextToText` for a vision-language checkpoint (its
    architecture in that mapping), else `NeuronAutoModelForCausalLM` (split between the job's
    `tp_size` ranks when above 1), in `dtype` (None: the checkpoint's). The checkpoint is resolved
    first, so that a wrong name or folder gets the loader's error."""
    config = AutoConfig.from_pretrained(resolve_checkpoint(name_or_path).folder)
    auto_class = NeuronAutoModelForSeq2SeqLM if config.is_encoder_decoder else NeuronAutoModelForCausalLM
    if neuron_auto_class_for(config) is NeuronAutoModelForImageTextToText:
        auto_class = NeuronAutoModelForImageTextToText
    options = {"tp_size": tp_size} if tp_size > 1 else {}
    return auto_class.from_pretrained(name_or_path, dtype=dtype, **options)
