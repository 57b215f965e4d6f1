"""Pipelines of audio and images on the `neuron` device give what Transformers' pipelines give on
the CPU, on tiny checkpoints with their real feature extractors, image processors and tokenizers;
Whisper's speech recognition and LLaVA's image-text-to-text generate on compiled graphs."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy
import PIL.Image
import pytest
import transformers

import optimum_neuron_torch as ont
from optimum_neuron_torch.errors import ConfigurationError
from optimum_neuron_torch.generation.mixin import NeuronGenerationMixin
from testing_utils import assert_same_output
from tiny_models import TINY_MODELS, save_audio_and_image_checkpoint, tones

IMAGE = PIL.Image.fromarray(numpy.random.RandomState(0).randint(0, 256, (48, 40, 3), dtype=numpy.uint8))
CHAT = [{"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": "what is it?"}]}]
# (Transformers' speech recognition pipeline searches 5 beams by default, whose decode steps run eagerly)
WHISPER = dict(generate_kwargs={"max_new_tokens": 8, "num_beams": 1})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The folder of a tiny audio or image checkpoint (`save_audio_and_image_checkpoint`), saved once."""
    folders: dict[str, Path] = {}

    def folder(name: str) -> Path:
        if name not in folders:
            folders[name] = save_audio_and_image_checkpoint(name, tmp_path_factory.mktemp(name))
        return folders[name]

    return folder


@pytest.mark.parametrize(("task", "name", "inputs", "kwargs"), [
    ("automatic-speech-recognition", "wav2vec2_ctc", tones(2.5), {}),
    ("audio-classification", "wav2vec2_audio", tones(1.5), {"top_k": 3}),
    ("image-classification", "vit", IMAGE, {"top_k": 5}),
    ("text-to-audio", "vits", "hello world", {}),
    # (compiling Whisper's two graphs: the fast tier compiles them in test_speech.py)
    pytest.param("automatic-speech-recognition", "whisper", tones(3), WHISPER, marks=pytest.mark.slow),
    # (compiling LLaVA's three graphs: the fast tier compiles them in test_vision_language.py)
    pytest.param("image-text-to-text", "llava", CHAT, {"max_new_tokens": 6, "do_sample": False},
                 marks=pytest.mark.slow),
])
def test_task_matches_transformers_on_cpu(checkpoint, task, name, inputs, kwargs):
    folder = checkpoint(name)
    on_device = ont.pipeline(task, str(folder))
    assert on_device.model.device.type == "neuron" and on_device.device.type == "neuron"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = on_device(inputs, **kwargs) if task != "image-text-to-text" else on_device(text=inputs, **kwargs)
    assert not [str(warning.message) for warning in caught if "eager" in str(warning.message)]  # (all compiled)
    cpu = transformers.pipeline(task, model=str(folder), device="cpu")
    assert_same_output(output, cpu(inputs, **kwargs) if task != "image-text-to-text" else cpu(text=inputs, **kwargs))
    # (compiled generation: Whisper's and LLaVA's)
    assert isinstance(on_device.model, NeuronGenerationMixin) == (name in ("whisper", "llava"))


@pytest.mark.slow
def test_whisper_transcribes_long_audio_in_chunks_with_timestamps_as_on_the_cpu(checkpoint):
    """75 seconds in 30-second chunks (overlapping by Transformers' default stride), batched two at
    a time, with timestamps: the CPU's chunks and text, never truncated."""
    folder, audio = checkpoint("whisper"), tones(75, seed=4)
    kwargs = dict(chunk_length_s=30, batch_size=2, return_timestamps=True, **WHISPER)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = ont.pipeline("automatic-speech-recognition", str(folder))(audio, **kwargs)
    assert not [str(warning.message) for warning in caught if "eager" in str(warning.message)]  # (all compiled)
    expected = transformers.pipeline("automatic-speech-recognition", model=str(folder), device="cpu")(audio, **kwargs)
    assert_same_output(output, expected)
    assert output["chunks"] and output["chunks"][-1]["timestamp"][1] is not None


def test_bad_audio_and_images(checkpoint):
    """A silent clip gives the CPU's transcript, not an error; an image the processor cannot read
    fails naming it. (Audio at another sampling rate is Transformers' to resample, with torchaudio,
    which has no release for torch 2.13: it refuses such audio, naming torchaudio, on the CPU too.)"""
    asr = ont.pipeline("automatic-speech-recognition", str(checkpoint("wav2vec2_ctc")))
    cpu_asr = transformers.pipeline("automatic-speech-recognition", model=str(checkpoint("wav2vec2_ctc")),
                                    device="cpu")
    silence = numpy.zeros(16000, dtype=numpy.float32)
    assert_same_output(asr(silence), cpu_asr(silence))
    classifier = ont.pipeline("image-classification", str(checkpoint("vit")))
    with pytest.raises(Exception, match="no-such-image.png"):
        classifier("no-such-image.png")


@pytest.mark.slow  # (the fast tier's budget: check() compiles each model)
def test_check_feeds_audio_models_their_own_inputs(checkpoint):
    """`check()` of a speech model runs it on its own input (log-mel features, raw samples), not token
    ids: Whisper compiles whole and lowers to StableHLO; wav2vec2's weight norm falls back, and is named."""
    whisper = ont.check(str(checkpoint("whisper")))
    assert whisper.verdict == "runs natively" and whisper.compile_error is None
    assert whisper.stablehlo == "1 of 1 compiled graph(s) lower to StableHLO"
    wav2vec2 = ont.check(str(checkpoint("wav2vec2_ctc")))
    assert wav2vec2.verdict == "runs with fallbacks" and wav2vec2.compile_error is None
    assert "aten::_weight_norm_interface" in [fallback.op for fallback in wav2vec2.fallbacks]


def test_a_task_without_a_model_for_the_checkpoint_is_refused_naming_both(tmp_path):
    folder = TINY_MODELS["llama"].save(tmp_path / "llama")
    with pytest.raises(ConfigurationError, match=r"'automatic-speech-recognition' task has no model for .*'llama'"):
        ont.pipeline("automatic-speech-recognition", str(folder))
