"""Speech models on `neuron`: Whisper's own generate() on compiled graphs (an encoder and a decode
step per batch bucket, whatever the audio's length), its tokens those of Transformers on the CPU."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers

from optimum_neuron_torch.errors import ConfigurationError
from optimum_neuron_torch.generation import Buckets, describe_plan, enable_compiled_generation
from testing_utils import clear_counts, graphs, recompiles
from tiny_models import tiny_whisper, tones

FEATURES = transformers.WhisperFeatureExtractor()  # (80 mel bins, 30-second windows of 3000 frames)


def features(*seconds: float, long: bool = False) -> transformers.BatchFeature:
    """Log-mel features of a clip per length in `seconds` (tones of different pitches): one window
    each, or with `long` the frames of the longest, and their mask (Whisper's long-form input)."""
    clips = [tones(length, seed=index) for index, length in enumerate(seconds)]
    if long:
        return FEATURES(clips, sampling_rate=16000, return_tensors="pt", truncation=False, padding="longest",
                        return_attention_mask=True)
    return FEATURES(clips, sampling_rate=16000, return_tensors="pt")


@pytest.fixture(scope="module")
def whisper():
    """(CPU model, the same on the device with compiled generation, warmed up on batch buckets 1 and 4)."""
    torch._dynamo.reset()
    cpu = tiny_whisper()
    model = enable_compiled_generation(copy.deepcopy(cpu).to("neuron"), Buckets((1, 4), (16,), 64))
    clear_counts()
    model.precompile(show_progress=False)
    assert describe_plan(model.neuron_generation.graph_plan()) == "4 graphs: 2 encoder, 2 decode"
    assert graphs() == 4
    return cpu, model


@pytest.mark.slow
def test_whisper_transcribes_clips_of_any_length_as_on_the_cpu_without_compiling_again(whisper):
    """Clips of 1, 10 and 29 s, batches of 1, 2 and 3 (filled to the bucket of 4), and a 45-second
    clip that Whisper's long-form generation cuts into two windows, with timestamps: the CPU's
    tokens, and no graph compiled after the warm-up."""
    cpu, model = whisper
    clear_counts()
    for seconds in ((1,), (10, 29, 3), (29, 12)):
        inputs = features(*seconds).input_features
        expected = cpu.generate(inputs, max_new_tokens=12)
        generated = model.generate(inputs.to("neuron"), max_new_tokens=12)
        assert generated.device.type == "neuron" and generated.shape[0] == len(seconds)
        assert generated.cpu().tolist() == expected.tolist(), seconds
    long = features(45, long=True)
    assert long.input_features.shape[-1] > 3000  # (two windows)
    expected = cpu.generate(long.input_features, attention_mask=long.attention_mask, return_timestamps=True)
    generated = model.generate(long.input_features.to("neuron"), attention_mask=long.attention_mask.to("neuron"),
                               return_timestamps=True)
    assert expected.shape[-1] > 20 and generated.cpu().tolist() == expected.tolist()
    assert graphs() == 0 and recompiles() == 0


def test_whisper_generates_compiled_on_one_batch_bucket(fresh_dynamo):
    """The fast tier's check: one clip on batch bucket 1 compiles an encoder and a decode step and
    gives the CPU's tokens; a call asking for more positions than the cache holds is refused,
    naming them; beam search gives the CPU's tokens, its encoder compiled, its decode steps eager
    (Transformers' beam search calls the model itself), with a warning that says so."""
    cpu = tiny_whisper()
    model = enable_compiled_generation(copy.deepcopy(cpu).to("neuron"), Buckets((1,), (16,), 32))
    inputs = features(3).input_features
    assert model.generate(inputs.to("neuron"), max_new_tokens=8).cpu().tolist() == \
        cpu.generate(inputs, max_new_tokens=8).tolist()
    assert graphs() == 2
    with pytest.raises(ConfigurationError, match="needs 41 decoder positions where the compiled cache holds 32"):
        model.generate(inputs.to("neuron"), max_new_tokens=40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        beams = model.generate(inputs.to("neuron"), max_new_tokens=4, num_beams=2)
    assert beams.cpu().tolist() == cpu.generate(inputs, max_new_tokens=4, num_beams=2).tolist()
    assert any("beam search (num_beams=2) runs its encoder compiled but its decode steps eagerly"
               in str(warning.message) for warning in caught)
    assert graphs() == 2  # (batch bucket 1: its encoder ran compiled)


def test_a_speech_model_takes_the_arguments_its_processor_gives_as_on_the_cpu(fresh_dynamo):
    """Cohere ASR's processor gives `audio_chunk_index`, which its `prepare_inputs_for_generation`
    takes (and drops): Transformers accepts the argument from that method's signature, which the
    device's model class keeps; its tokens are the CPU's (eagerly: its input is features, not ids)."""
    config = transformers.CohereAsrConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, encoder_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                  num_key_value_heads=4, intermediate_size=64,
                                                  subsampling_conv_channels=8))
    torch.manual_seed(0)
    cpu = transformers.CohereAsrForConditionalGeneration(config).eval()
    inputs = transformers.CohereAsrFeatureExtractor()(tones(1.0), sampling_rate=16000, return_tensors="pt")
    assert "audio_chunk_index" in inputs
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    expected = cpu.generate(**inputs, **settings)
    model = enable_compiled_generation(copy.deepcopy(cpu).to("neuron"))
    with pytest.warns(UserWarning, match="generation without a 2D tensor of input ids"):
        generated = model.generate(**inputs.to("neuron"), **settings)
    assert generated.cpu().tolist() == expected.tolist()
