"""Neuron Auto classes: Transformers' Auto classes whose `from_pretrained` streams the weights
straight onto the `neuron` device and returns the plain Transformers model."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from transformers import (
    AutoModel,
    AutoModelForAudioClassification,
    AutoModelForCausalLM,
    AutoModelForCTC,
    AutoModelForImageClassification,
    AutoModelForImageTextToText,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForSpeechSeq2Seq,
    AutoModelForTextToSpectrogram,
    AutoModelForTextToWaveform,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from ..fallbacks.policy import watch as watch_fallbacks
from ..generation import enable_compiled_generation
from ..loading import LoadOptions, load_pretrained
from ..patches import apply_patches
from ..training import save_random_ops_when_checkpointing, trainer_integration


class _NeuronAutoMixin:
    """Replaces `from_pretrained` with the streaming loader; everything else is the Auto class's."""

    compiled_generation = False  # generate() through compiled graphs (see optimum_neuron_torch.generation)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike[str],
        *,
        patches: bool | Iterable[str] = True,
        **kwargs: Any,
    ) -> PreTrainedModel:
        """Loads the model of a checkpoint straight onto the `neuron` device, streaming its weights
        from disk one tensor at a time (never a full host copy), and returns the plain Transformers
        model in eval mode, with the model patches its architecture needs applied.

        Args:
            pretrained_model_name_or_path (`str` or `os.PathLike`):
                A Hub model id (`"org/model-id"`) or a local checkpoint folder.
            revision (`str`, *optional*):
                The Hub revision (branch, tag or commit) to download.
            dtype (`torch.dtype` or `str`, *optional*):
                The dtype of the weights (`torch.bfloat16` or `"bfloat16"`); defaults to the
                checkpoint's (`"auto"`: the config's `dtype`, else the first floating weight's).
            device (`torch.device` or `str`, *optional*, defaults to `"neuron"`):
                Where to load the model (`"neuron"` is the current `neuron` device).
            token (`str` or `bool`, *optional*):
                The Hub token, for gated or private repositories.
            cache_dir (`str` or `os.PathLike`, *optional*):
                The Hugging Face cache folder to download into.
            local_files_only (`bool`, *optional*, defaults to `False`):
                Whether to use only files already in the cache (no download).
            trust_remote_code (`bool`, *optional*, defaults to `False`):
                Whether to run the model code a checkpoint ships (`auto_map` in its config).
            allow_pickle (`bool`, *optional*, defaults to `False`):
                Whether to load pickled weights (`pytorch_model.bin`) when the checkpoint has no
                safetensors; they are read with `weights_only=True`.
            ignore_mismatched_sizes (`bool`, *optional*, defaults to `False`):
                Whether to initialize, rather than refuse, weights whose shape differs from the
                checkpoint's (e.g. a classification head with another number of labels).
            attn_implementation (`str`, *optional*):
                The attention implementation (`"eager"`, `"sdpa"`, ...), as in Transformers.
            patches (`bool` or `Iterable[str]`, *optional*, defaults to `True`):
                The model patches to apply (see `optimum_neuron_torch.patches`): `True`, all that the
                model needs; an iterable of names, those among them it needs; `False`, none. The
                patches applied are listed on `model.neuron_patches`.
            distributed_config (`DistributedConfig` or `dict`, *optional*):
                Tensor parallelism, as Transformers takes it: `DistributedConfig(tp_size=N)` splits
                the model by its own tensor-parallel plan between the N ranks of a `torchrun` job
                (one `neuron` device each); every rank reads from the files only the pieces it keeps.
            tp_plan (`str` or `dict`, *optional*):
                The older form of `distributed_config=DistributedConfig(tp_plan=...)` (`"auto"`: the
                model's own plan), still accepted as Transformers accepts it.
            tp_size (`int`, *optional*):
                The older form of `distributed_config=DistributedConfig(tp_size=...)`.
            kwargs (`dict[str, Any]`, *optional*):
                The loading options above (`revision` to `tp_size`, gathered in `LoadOptions`), and
                config attributes to override (`num_labels=3`, `use_cache=False`, ...).

        Returns:
            [`~transformers.PreTrainedModel`]: the Transformers model of the checkpoint's
            architecture, on `device`, in eval mode; causal and seq2seq language models generate
            through compiled graphs (see `optimum_neuron_torch.generation`).

        Raises:
            [`~optimum_neuron_torch.errors.CheckpointNotFoundError`]:
                If the checkpoint, or a file it needs, cannot be found.
            [`~optimum_neuron_torch.errors.UnsafeCheckpointError`]:
                If the checkpoint has only pickled weights and `allow_pickle` is `False`.
            [`~optimum_neuron_torch.errors.CheckpointError`]:
                If the checkpoint cannot be loaded (a corrupt file, a missing or mismatched tensor).
            [`~optimum_neuron_torch.errors.UnsupportedModelError`]:
                If this class has no model for the checkpoint's configuration.
            [`~optimum_neuron_torch.errors.ConfigurationError`]:
                If `dtype` is not a torch dtype, if the model's code ships with the checkpoint and
                `trust_remote_code` is `False`, or if `patches` names an unknown patch.
            [`~optimum_neuron_torch.errors.ArgumentTypeError`]:
                If a keyword argument is neither one of these nor a config attribute.
            [`~optimum_neuron_torch.errors.InsufficientDeviceMemoryError`]:
                If the model does not fit in the device's free memory (checked before loading).
            [`~optimum_neuron_torch.errors.RankFailedError`]:
                Under tensor parallelism, if another rank failed to load (the message names it and
                its error); every rank raises, none is left waiting. A `tp_size` that differs from
                the job's number of processes or does not divide the attention heads, and a model
                without a tensor-parallel plan, raise `ConfigurationError` and
                `UnsupportedModelError` before anything is loaded.

        Example:

        ```python
        >>> import torch
        >>> from transformers import AutoTokenizer
        >>> from optimum_neuron_torch import NeuronAutoModelForCausalLM

        >>> model = NeuronAutoModelForCausalLM.from_pretrained("org/model-id", dtype=torch.bfloat16)
        >>> tokenizer = AutoTokenizer.from_pretrained("org/model-id")
        >>> inputs = tokenizer("The capital of France is", return_tensors="pt").to("neuron")
        >>> tokenizer.decode(model.generate(**inputs, max_new_tokens=8)[0])
        ```
        """
        options, config_kwargs = LoadOptions.split(kwargs)  # (the loading options, defined once there)
        model = load_pretrained(cls, pretrained_model_name_or_path, options, **config_kwargs)
        apply_patches(model, None if patches is True else () if patches is False else patches)
        watch_fallbacks(model)  # (under the fallback policy, wherever it is now: it may move to `neuron` later)
        if model.device.type == "neuron":
            trainer_integration.enable()  # Trainer on `neuron` (see optimum_neuron_torch.training)
            save_random_ops_when_checkpointing(model)
            if cls.compiled_generation:
                enable_compiled_generation(model, saved=model.neuron_checkpoint_folder)
        return model


class NeuronAutoModel(_NeuronAutoMixin, AutoModel):
    """The base model (hidden states), e.g. for feature extraction and sentence embeddings (see `embed`).

    Not instantiated: `from_pretrained` loads the checkpoint's model straight onto the `neuron`
    device and returns the plain Transformers model; its docstring lists the arguments (Args),
    what it returns (Returns) and the errors it raises (Raises).

    Example:

    ```python
    >>> from transformers import AutoTokenizer
    >>> from optimum_neuron_torch import NeuronAutoModel

    >>> model = NeuronAutoModel.from_pretrained("sentence-transformers/all-MiniLM-L6-v2")
    >>> tokenizer = AutoTokenizer.from_pretrained("sentence-transformers/all-MiniLM-L6-v2")
    >>> outputs = model(**tokenizer("Hello", return_tensors="pt").to("neuron"))
    >>> outputs.last_hidden_state.shape
    torch.Size([1, 3, 384])
    ```
    """


class NeuronAutoModelForCausalLM(_NeuronAutoMixin, AutoModelForCausalLM):
    """Decoder language models (Llama, Mistral, Qwen2, Gemma2, GPT-2, ...), with compiled generation:
    `generate()` runs on static-shape graphs compiled once and cached on disk.

    Not instantiated: `from_pretrained` loads the checkpoint's model straight onto the `neuron`
    device and returns the plain Transformers model; its docstring lists the arguments (Args),
    what it returns (Returns) and the errors it raises (Raises).

    Example:

    ```python
    >>> from transformers import AutoTokenizer
    >>> from optimum_neuron_torch import NeuronAutoModelForCausalLM

    >>> model = NeuronAutoModelForCausalLM.from_pretrained("org/model-id")
    >>> tokenizer = AutoTokenizer.from_pretrained("org/model-id")
    >>> inputs = tokenizer("The capital of France is", return_tensors="pt").to("neuron")
    >>> tokenizer.decode(model.generate(**inputs, max_new_tokens=8)[0])
    ```
    """

    compiled_generation = True


class NeuronAutoModelForSeq2SeqLM(_NeuronAutoMixin, AutoModelForSeq2SeqLM):
    """Encoder-decoder language models (T5, BART, ...), with compiled generation.

    Not instantiated: `from_pretrained` loads the checkpoint's model straight onto the `neuron`
    device and returns the plain Transformers model; its docstring lists the arguments (Args),
    what it returns (Returns) and the errors it raises (Raises).

    Example:

    ```python
    >>> from transformers import AutoTokenizer
    >>> from optimum_neuron_torch import NeuronAutoModelForSeq2SeqLM

    >>> model = NeuronAutoModelForSeq2SeqLM.from_pretrained("google-t5/t5-small")
    >>> tokenizer = AutoTokenizer.from_pretrained("google-t5/t5-small")
    >>> inputs = tokenizer("translate English to German: Hello", return_tensors="pt").to("neuron")
    >>> tokenizer.decode(model.generate(**inputs, max_new_tokens=8)[0], skip_special_tokens=True)
    ```
    """

    compiled_generation = True


class NeuronAutoModelForMaskedLM(_NeuronAutoMixin, AutoModelForMaskedLM):
    """Masked language models (BERT, RoBERTa, ...).

    Not instantiated: `from_pretrained` loads the checkpoint's model straight onto the `neuron`
    device and returns the plain Transformers model; its docstring lists the arguments (Args),
    what it returns (Returns) and the errors it raises (Raises).

    Example:

    ```python
    >>> from transformers import AutoTokenizer
    >>> from optimum_neuron_torch import NeuronAutoModelForMaskedLM

    >>> model = NeuronAutoModelForMaskedLM.from_pretrained("google-bert/bert-base-uncased")
    >>> tokenizer = AutoTokenizer.from_pretrained("google-bert/bert-base-uncased")
    >>> logits = model(**tokenizer("Paris is the [MASK] of France.", return_tensors="pt").to("neuron")).logits
    ```
    """


class NeuronAutoModelForSequenceClassification(_NeuronAutoMixin, AutoModelForSequenceClassification):
    """Models with a sequence classification head.

    Not instantiated: `from_pretrained` loads the checkpoint's model straight onto the `neuron`
    device and returns the plain Transformers model; its docstring lists the arguments (Args),
    what it returns (Returns) and the errors it raises (Raises).

    Example:

    ```python
    >>> from transformers import AutoTokenizer
    >>> from optimum_neuron_torch import NeuronAutoModelForSequenceClassification

    >>> model_id = "distilbert/distilbert-base-uncased-finetuned-sst-2-english"
    >>> model = NeuronAutoModelForSequenceClassification.from_pretrained(model_id)
    >>> tokenizer = AutoTokenizer.from_pretrained(model_id)
    >>> logits = model(**tokenizer("I loved it", return_tensors="pt").to("neuron")).logits
    >>> model.config.id2label[logits.argmax(-1).item()]
    'POSITIVE'
    ```
    """


class NeuronAutoModelForTokenClassification(_NeuronAutoMixin, AutoModelForTokenClassification):
    """Models with a token classification head (named entities, parts of speech).

    Not instantiated: `from_pretrained` loads the checkpoint's model straight onto the `neuron`
    device and returns the plain Transformers model; its docstring lists the arguments (Args),
    what it returns (Returns) and the errors it raises (Raises).

    Example:

    ```python
    >>> from transformers import AutoTokenizer
    >>> from optimum_neuron_torch import NeuronAutoModelForTokenClassification

    >>> model = NeuronAutoModelForTokenClassification.from_pretrained("dslim/bert-base-NER")
    >>> tokenizer = AutoTokenizer.from_pretrained("dslim/bert-base-NER")
    >>> logits = model(**tokenizer("Ada lives in London", return_tensors="pt").to("neuron")).logits
    ```
    """


class NeuronAutoModelForQuestionAnswering(_NeuronAutoMixin, AutoModelForQuestionAnswering):
    """Models with an extractive question answering head.

    Not instantiated: `from_pretrained` loads the checkpoint's model straight onto the `neuron`
    device and returns the plain Transformers model; its docstring lists the arguments (Args),
    what it returns (Returns) and the errors it raises (Raises).

    Example:

    ```python
    >>> from transformers import AutoTokenizer
    >>> from optimum_neuron_torch import NeuronAutoModelForQuestionAnswering

    >>> model = NeuronAutoModelForQuestionAnswering.from_pretrained("distilbert/distilbert-base-cased-distilled-squad")
    >>> tokenizer = AutoTokenizer.from_pretrained("distilbert/distilbert-base-cased-distilled-squad")
    >>> inputs = tokenizer("Where is Paris?", "Paris is in France.", return_tensors="pt").to("neuron")
    >>> outputs = model(**inputs)  # outputs.start_logits, outputs.end_logits
    ```
    """


class NeuronAutoModelForSpeechSeq2Seq(_NeuronAutoMixin, AutoModelForSpeechSeq2Seq):
    """Speech-to-text encoder-decoders (Whisper, ...), with compiled generation: Whisper's own
    `generate()` (30-second windows, timestamps, languages) runs its encoder and decode steps on
    graphs compiled once per batch bucket, whatever the audio's length (see
    `optimum_neuron_torch.generation.speech_graphs`).

    Not instantiated: `from_pretrained` loads the checkpoint's model straight onto the `neuron`
    device and returns the plain Transformers model; its docstring lists the arguments (Args),
    what it returns (Returns) and the errors it raises (Raises).

    Example:

    ```python
    >>> from transformers import AutoProcessor
    >>> from optimum_neuron_torch import NeuronAutoModelForSpeechSeq2Seq

    >>> model = NeuronAutoModelForSpeechSeq2Seq.from_pretrained("openai/whisper-tiny.en")
    >>> processor = AutoProcessor.from_pretrained("openai/whisper-tiny.en")
    >>> inputs = processor(audio, sampling_rate=16000, return_tensors="pt").to("neuron")  # audio: 16 kHz samples
    >>> processor.batch_decode(model.generate(**inputs), skip_special_tokens=True)
    ```
    """

    compiled_generation = True


class NeuronAutoModelForCTC(_NeuronAutoMixin, AutoModelForCTC):
    """Speech recognition models with a CTC head (wav2vec2, HuBERT, ...).

    Not instantiated: `from_pretrained` loads the checkpoint's model straight onto the `neuron`
    device and returns the plain Transformers model; its docstring lists the arguments (Args),
    what it returns (Returns) and the errors it raises (Raises).

    Example:

    ```python
    >>> from transformers import AutoProcessor
    >>> from optimum_neuron_torch import NeuronAutoModelForCTC

    >>> model = NeuronAutoModelForCTC.from_pretrained("facebook/wav2vec2-base-960h")
    >>> processor = AutoProcessor.from_pretrained("facebook/wav2vec2-base-960h")
    >>> logits = model(**processor(audio, sampling_rate=16000, return_tensors="pt").to("neuron")).logits
    >>> processor.batch_decode(logits.argmax(-1))
    ```
    """


class NeuronAutoModelForAudioClassification(_NeuronAutoMixin, AutoModelForAudioClassification):
    """Audio classification models (keyword spotting, speaker or emotion recognition, ...).

    Not instantiated: `from_pretrained` loads the checkpoint's model straight onto the `neuron`
    device and returns the plain Transformers model; its docstring lists the arguments (Args),
    what it returns (Returns) and the errors it raises (Raises).

    Example:

    ```python
    >>> from optimum_neuron_torch import NeuronAutoModelForAudioClassification

    >>> model = NeuronAutoModelForAudioClassification.from_pretrained("superb/wav2vec2-base-superb-ks")
    ```
    """


class NeuronAutoModelForTextToWaveform(_NeuronAutoMixin, AutoModelForTextToWaveform):
    """Text-to-speech models that give a waveform (VITS/MMS-TTS, Bark, MusicGen, ...).

    Not instantiated: `from_pretrained` loads the checkpoint's model straight onto the `neuron`
    device and returns the plain Transformers model; its docstring lists the arguments (Args),
    what it returns (Returns) and the errors it raises (Raises).

    Example:

    ```python
    >>> from transformers import AutoTokenizer
    >>> from optimum_neuron_torch import NeuronAutoModelForTextToWaveform

    >>> model = NeuronAutoModelForTextToWaveform.from_pretrained("facebook/mms-tts-eng")
    >>> tokenizer = AutoTokenizer.from_pretrained("facebook/mms-tts-eng")
    >>> waveform = model(**tokenizer("Hello", return_tensors="pt").to("neuron")).waveform
    ```
    """


class NeuronAutoModelForTextToSpectrogram(_NeuronAutoMixin, AutoModelForTextToSpectrogram):
    """Text-to-speech models that give a spectrogram for a vocoder (SpeechT5, FastSpeech2, ...).

    Not instantiated: `from_pretrained` loads the checkpoint's model straight onto the `neuron`
    device and returns the plain Transformers model; its docstring lists the arguments (Args),
    what it returns (Returns) and the errors it raises (Raises).

    Example:

    ```python
    >>> from optimum_neuron_torch import NeuronAutoModelForTextToSpectrogram

    >>> model = NeuronAutoModelForTextToSpectrogram.from_pretrained("microsoft/speecht5_tts")
    ```
    """


class NeuronAutoModelForImageClassification(_NeuronAutoMixin, AutoModelForImageClassification):
    """Image classification models (ViT, ConvNeXt, ...).

    Not instantiated: `from_pretrained` loads the checkpoint's model straight onto the `neuron`
    device and returns the plain Transformers model; its docstring lists the arguments (Args),
    what it returns (Returns) and the errors it raises (Raises).

    Example:

    ```python
    >>> from transformers import AutoImageProcessor
    >>> from optimum_neuron_torch import NeuronAutoModelForImageClassification

    >>> model = NeuronAutoModelForImageClassification.from_pretrained("google/vit-base-patch16-224")
    >>> processor = AutoImageProcessor.from_pretrained("google/vit-base-patch16-224")
    >>> logits = model(**processor(image, return_tensors="pt").to("neuron")).logits
    >>> model.config.id2label[logits.argmax(-1).item()]
    ```
    """


class NeuronAutoModelForImageTextToText(_NeuronAutoMixin, AutoModelForImageTextToText):
    """Vision-language models that answer in text (LLaVA, Qwen2-VL, Gemma 3, Idefics, ...), with
    compiled generation for LLaVA and the models built like it: their images are encoded by a graph
    compiled once per batch bucket and their prompts run on a text model's graphs (see
    `optimum_neuron_torch.generation.vision_graphs`); the others generate eagerly on the device.

    Not instantiated: `from_pretrained` loads the checkpoint's model straight onto the `neuron`
    device and returns the plain Transformers model; its docstring lists the arguments (Args),
    what it returns (Returns) and the errors it raises (Raises).

    Example:

    ```python
    >>> from transformers import AutoProcessor
    >>> from optimum_neuron_torch import NeuronAutoModelForImageTextToText

    >>> model = NeuronAutoModelForImageTextToText.from_pretrained("llava-hf/llava-interleave-qwen-0.5b-hf")
    >>> processor = AutoProcessor.from_pretrained("llava-hf/llava-interleave-qwen-0.5b-hf")
    ```
    """

    compiled_generation = True


HEAD_CLASSES = (
    NeuronAutoModelForCausalLM,
    NeuronAutoModelForSeq2SeqLM,
    NeuronAutoModelForSpeechSeq2Seq,
    NeuronAutoModelForImageTextToText,
    NeuronAutoModelForMaskedLM,
    NeuronAutoModelForSequenceClassification,
    NeuronAutoModelForTokenClassification,
    NeuronAutoModelForQuestionAnswering,
    NeuronAutoModelForCTC,
    NeuronAutoModelForAudioClassification,
    NeuronAutoModelForTextToWaveform,
    NeuronAutoModelForTextToSpectrogram,
    NeuronAutoModelForImageClassification,
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
