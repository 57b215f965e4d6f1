"""`serving.transcriptions.read_audio`: what an uploaded WAV file becomes (mono float32 in [-1, 1] at the
model's rate), for every sample width and channel count scipy reads."""

from __future__ import annotations

import io

import numpy
import pytest
import scipy.io.wavfile

from optimum_neuron_torch.errors import InvalidRequestError
from optimum_neuron_torch.serving.transcriptions import read_audio


def wav_file(samples: numpy.ndarray, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    scipy.io.wavfile.write(buffer, rate, samples)
    return buffer.getvalue()


@pytest.mark.parametrize("dtype", ["uint8", "int16", "int32", "float32"])
def test_each_width_and_channel_count_reads_as_mono_floats_in_unit_range(dtype):
    left = numpy.array([0.5, -0.5, 0.25, 0.0], dtype=numpy.float32)
    right = numpy.array([0.25, -0.25, -0.25, 0.0], dtype=numpy.float32)
    if dtype == "uint8":
        encode = lambda x: (x * 128 + 128).astype(numpy.uint8)  # noqa: E731
    elif dtype == "float32":
        encode = lambda x: x  # noqa: E731
    else:
        encode = lambda x: (x * numpy.iinfo(dtype).max).astype(dtype)  # noqa: E731
    mono = read_audio(wav_file(encode(left)), 16000)
    stereo = read_audio(wav_file(numpy.stack([encode(left), encode(right)], axis=1)), 16000)
    tolerance = 1 / 128 if dtype == "uint8" else 1e-4
    assert mono.dtype == numpy.float32 and stereo.dtype == numpy.float32
    numpy.testing.assert_allclose(mono, left, atol=tolerance)
    numpy.testing.assert_allclose(stereo, (left + right) / 2, atol=tolerance)


def test_another_rate_is_resampled_to_the_models():
    samples = numpy.sin(numpy.linspace(0, 40, 8000)).astype(numpy.float32)
    resampled = read_audio(wav_file(samples, 8000), 16000)
    assert resampled.dtype == numpy.float32 and len(resampled) == 16000


@pytest.mark.parametrize("data", [b"", b"not audio at all"])
def test_what_is_not_a_wav_file_is_refused_naming_the_field(data):
    with pytest.raises(InvalidRequestError) as error:
        read_audio(data, 16000)
    assert error.value.param == "file"
