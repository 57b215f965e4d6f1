"""Neuron Auto classes, and sentence embeddings on top of `NeuronAutoModel`."""

from .auto import (
    NeuronAutoModel,
    NeuronAutoModelForCausalLM,
    NeuronAutoModelForMaskedLM,
    NeuronAutoModelForQuestionAnswering,
    NeuronAutoModelForSeq2SeqLM,
    NeuronAutoModelForSequenceClassification,
    NeuronAutoModelForTokenClassification,
    neuron_auto_class_for,
)
from .embeddings import embed, pool

__all__ = [
    "NeuronAutoModel",
    "NeuronAutoModelForCausalLM",
    "NeuronAutoModelForMaskedLM",
    "NeuronAutoModelForQuestionAnswering",
    "NeuronAutoModelForSeq2SeqLM",
    "NeuronAutoModelForSequenceClassification",
    "NeuronAutoModelForTokenClassification",
    "embed",
    "neuron_auto_class_for",
    "pool",
]
