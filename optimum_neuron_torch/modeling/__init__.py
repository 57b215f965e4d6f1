"""Neuron Auto classes, and sentence embeddings on top of `NeuronAutoModel`."""

from .auto import (
    NeuronAutoModel,
    NeuronAutoModelForAudioClassification,
    NeuronAutoModelForCausalLM,
    NeuronAutoModelForCTC,
    NeuronAutoModelForImageClassification,
    NeuronAutoModelForImageTextToText,
    NeuronAutoModelForMaskedLM,
    NeuronAutoModelForQuestionAnswering,
    NeuronAutoModelForSeq2SeqLM,
    NeuronAutoModelForSequenceClassification,
    NeuronAutoModelForSpeechSeq2Seq,
    NeuronAutoModelForTextToSpectrogram,
    NeuronAutoModelForTextToWaveform,
    NeuronAutoModelForTokenClassification,
    neuron_auto_class_for,
)
from .embeddings import embed, pool

__all__ = [
    "NeuronAutoModel",
    "NeuronAutoModelForCausalLM",
    "NeuronAutoModelForAudioClassification",
    "NeuronAutoModelForCTC",
    "NeuronAutoModelForImageClassification",
    "NeuronAutoModelForImageTextToText",
    "NeuronAutoModelForSpeechSeq2Seq",
    "NeuronAutoModelForTextToSpectrogram",
    "NeuronAutoModelForTextToWaveform",
    "NeuronAutoModelForMaskedLM",
    "NeuronAutoModelForQuestionAnswering",
    "NeuronAutoModelForSeq2SeqLM",
    "NeuronAutoModelForSequenceClassification",
    "NeuronAutoModelForTokenClassification",
    "embed",
    "neuron_auto_class_for",
    "pool",
]
