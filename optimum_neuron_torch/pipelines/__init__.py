"""`pipeline(task, model, device="neuron")`: Transformers pipelines whose model runs on the `neuron`
device, loaded with the task's Neuron Auto class, so that text generation runs on compiled graphs.

The pipeline is Transformers' own (`transformers.pipeline` given the loaded model), except for the
two tasks Transformers 5 removed, `text2text-generation` and `question-answering`, whose pipelines
live here. `transformers.pipeline(task, model=<a Neuron Auto model>, device="neuron")` works too:
the pipeline calls the model's own `generate()`, which stays compiled.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from transformers import AutoTokenizer, Pipeline, PreTrainedModel, PreTrainedTokenizerBase

from ..errors import ConfigurationError
from .question_answering import QuestionAnsweringPipeline
from .tasks import (
    MULTIMODAL_TASKS,
    PIPELINE_CLASSES,
    PREPROCESSING,
    auto_class_for,
    default_model,
    preprocessing,
    task_name,
)
from .text2text_generation import Text2TextGenerationPipeline

# Keyword arguments that apply to loading the model (and, the Hub ones, its tokenizer).
HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "trust_remote_code")
LOADING_KWARGS = (*HUB_KWARGS, "dtype", "patches", "model_kwargs", "distributed_config", "tp_plan", "tp_size")


def pipeline(
    task: str,
    model: str | os.PathLike[str] | PreTrainedModel | None = None,
    tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase | None = None,
    device: str | torch.device = "neuron",
    **kwargs: Any,
) -> Pipeline:
    """A Transformers pipeline for `task` whose model runs on the `neuron` device, loaded with the
    task's `NeuronAutoModel*` class (text generation then runs on compiled graphs).

    Args:
        task (`str`):
            The task: one of `optimum_neuron_torch.pipelines.tasks.NEURON_AUTO_CLASSES`
            (`"text-generation"`, `"feature-extraction"`, `"text2text-generation"`,
            `"question-answering"`, `"automatic-speech-recognition"`, `"audio-classification"`,
            `"text-to-audio"`, `"image-classification"`, `"image-text-to-text"`, ...) or an alias
            of one (`TASK_ALIASES`).
        model (`str`, `os.PathLike` or `PreTrainedModel`, *optional*):
            A Hub model id or a local folder (loaded with the task's Neuron Auto class), an
            already-loaded model, or `None` for the task's default model (text-generation:
            SmolLM2-135M-Instruct; feature-extraction: all-MiniLM-L6-v2, when installed).
        tokenizer (`str`, `os.PathLike` or `PreTrainedTokenizerBase`, *optional*):
            The tokenizer, or where to load it from; defaults to the model's. The tasks of audio and
            images get their feature extractor, image processor or processor from the model's
            checkpoint, as Transformers loads them (or pass `feature_extractor=`, `image_processor=`,
            `processor=`).
        device (`str` or `torch.device`, *optional*, defaults to `"neuron"`):
            Where the model runs.
        kwargs (`dict[str, Any]`, *optional*):
            `revision`, `token`, `cache_dir`, `local_files_only`, `trust_remote_code`, `dtype`,
            `patches`, `model_kwargs` (config overrides) and the tensor-parallel arguments
            (`tp_size`, `tp_plan`, `distributed_config`: inside a `torchrun` job, every rank
            builds the pipeline and calls it) go to the model's `from_pretrained`
            (the Hub ones to the tokenizer's too); the others (`max_new_tokens`, `top_k`,
            `batch_size`, ...) go to the pipeline.

    Returns:
        [`~transformers.Pipeline`]: the task's pipeline (Transformers' own, or this library's
        `Text2TextGenerationPipeline` / `QuestionAnsweringPipeline` for the tasks Transformers 5 removed).

    Raises:
        [`~optimum_neuron_torch.errors.ConfigurationError`]:
            If the task is not supported, if loading arguments come with an already-loaded model,
            if a loaded model has no `name_or_path` and no tokenizer is given, or if the task has
            no default model offline.
        [`~optimum_neuron_torch.errors.MissingDependencyError`]:
            If the task's default model ships in a package that is not installed.
        [`~optimum_neuron_torch.errors.CheckpointError`]:
            If the model's checkpoint cannot be found or loaded (see `NeuronAutoModel.from_pretrained`).

    Example:

    ```python
    >>> import optimum_neuron_torch as ont

    >>> generator = ont.pipeline("text-generation")  # the default model, SmolLM2-135M-Instruct
    >>> generator("What is the capital of France?", max_new_tokens=16)[0]["generated_text"]

    >>> qa = ont.pipeline("question-answering", "distilbert/distilbert-base-cased-distilled-squad")
    >>> qa(question="Where is Paris?", context="Paris is the capital of France.")["answer"]
    'France'
    ```
    """
    task = task_name(task)
    loading = {name: kwargs.pop(name) for name in LOADING_KWARGS if name in kwargs}
    if isinstance(model, PreTrainedModel):
        if loading:
            raise ConfigurationError(
                f"Loading arguments ({', '.join(loading)}) apply only when the pipeline loads the model, and "
                "the model passed is already loaded: pass its name or folder instead, or leave them out."
            )
        source = model.name_or_path
        if tokenizer is None and not source:
            raise ConfigurationError(
                "The model passed has no name_or_path to load its tokenizer from: pass tokenizer=."
            )
        hub = {}
    else:
        source = str(model if model is not None else default_model(task))
        hub = {name: loading[name] for name in HUB_KWARGS if name in loading}
        config_kwargs = loading.pop("model_kwargs", None) or {}
        model = auto_class_for(task, source, **hub).from_pretrained(source, device=device, **loading, **config_kwargs)
        device = model.device  # (its index: under tensor parallelism, this rank's device)
    if task in MULTIMODAL_TASKS:  # (Transformers loads their preprocessing from the checkpoint's folder)
        given = {"tokenizer": tokenizer, **{name: kwargs.pop(name) for name in PREPROCESSING if name in kwargs}}
        return transformers.pipeline(task, model=model, device=device, **preprocessing(task, source, given, **hub),
                                     **kwargs)
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or source), **hub)
    if task in PIPELINE_CLASSES:
        return PIPELINE_CLASSES[task](model=model, tokenizer=tokenizer, device=device, task=task, **kwargs)
    return transformers.pipeline(task, model=model, tokenizer=tokenizer, device=device, **kwargs)


__all__ = ["QuestionAnsweringPipeline", "Text2TextGenerationPipeline", "pipeline"]
