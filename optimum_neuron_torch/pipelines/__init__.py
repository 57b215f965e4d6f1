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

from .question_answering import QuestionAnsweringPipeline
from .tasks import NEURON_AUTO_CLASSES, PIPELINE_CLASSES, default_model, task_name
from .text2text_generation import Text2TextGenerationPipeline

# Keyword arguments that apply to loading the model (and, the Hub ones, its tokenizer).
HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "trust_remote_code")
LOADING_KWARGS = (*HUB_KWARGS, "dtype", "patches", "model_kwargs")


def pipeline(
    task: str,
    model: str | os.PathLike[str] | PreTrainedModel | None = None,
    tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase | None = None,
    device: str | torch.device = "neuron",
    **kwargs: Any,
) -> Pipeline:
    """The pipeline for `task` on `device`. `model` is a Hub id or a local folder (loaded with the
    task's Neuron Auto class; `revision`, `token`, `cache_dir`, `local_files_only`,
    `trust_remote_code`, `dtype`, `patches` and `model_kwargs` go to its `from_pretrained`), an
    already-loaded model, or None for the task's default model. The tokenizer defaults to the
    model's. Other keyword arguments (e.g. `max_new_tokens`, `top_k`, `batch_size`) go to the pipeline."""
    task = task_name(task)
    loading = {name: kwargs.pop(name) for name in LOADING_KWARGS if name in kwargs}
    if isinstance(model, PreTrainedModel):
        if loading:
            raise ValueError(f"Loading arguments ({', '.join(loading)}) apply only when the pipeline loads the model, and "
                             "the model passed is already loaded: pass its name or folder instead, or leave them out.")
        source = model.name_or_path
        if tokenizer is None and not source:
            raise ValueError("The model passed has no name_or_path to load its tokenizer from: pass tokenizer=.")
        hub = {}
    else:
        source = str(model if model is not None else default_model(task))
        hub = {name: loading[name] for name in HUB_KWARGS if name in loading}
        config_kwargs = loading.pop("model_kwargs", None) or {}
        model = NEURON_AUTO_CLASSES[task].from_pretrained(source, device=device, **loading, **config_kwargs)
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or source), **hub)
    if task in PIPELINE_CLASSES:
        return PIPELINE_CLASSES[task](model=model, tokenizer=tokenizer, device=device, task=task, **kwargs)
    return transformers.pipeline(task, model=model, tokenizer=tokenizer, device=device, **kwargs)


__all__ = ["QuestionAnsweringPipeline", "Text2TextGenerationPipeline", "pipeline"]
