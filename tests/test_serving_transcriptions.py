"""`/v1/audio/transcriptions` (`serving.transcriptions`): a tiny Whisper on compiled graphs, through the official
`openai` client and raw multipart requests, its transcripts those of Transformers' pipeline on the CPU."""

from __future__ import annotations

import asyncio
import io
import threading

import httpx
import numpy
import openai
import pytest
import scipy.io.wavfile
import transformers

import optimum_neuron_torch as ont
from optimum_neuron_torch.commands.serve import default_task
from optimum_neuron_torch.serving.app import build_app
from optimum_neuron_torch.serving.transcriptions import TranscriptionEngine, read_audio
from test_serving_app import call
from testing_utils import graphs
from tiny_models import save_audio_and_image_checkpoint, tones

pytestmark = pytest.mark.slow  # (the fast tier compiles Whisper's graphs once, in test_speech.py)

NAME = "tiny-whisper"
GREEDY = {"generate_kwargs": {"num_beams": 1, "max_new_tokens": 48}}  # (the engine's: 64 positions less 16)


def wav(samples: numpy.ndarray, rate: int = 16000) -> bytes:
    """A 16-bit PCM WAV file of `samples`."""
    buffer = io.BytesIO()
    scipy.io.wavfile.write(buffer, rate, (samples * 32767).astype(numpy.int16))
    return buffer.getvalue()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(application over a transcription engine of the tiny Whisper, the CPU pipeline, the engine)."""
    folder = save_audio_and_image_checkpoint("whisper", tmp_path_factory.mktemp("whisper"))
    assert default_task(str(folder)) == "transcribe"  # (what `serve` runs for such a folder)
    engine = TranscriptionEngine(ont.pipeline("automatic-speech-recognition", str(folder)))
    thread = threading.Thread(target=engine.run, args=(False,), daemon=True)
    thread.start()
    engine.wait_ready(600)
    yield build_app(engine, NAME), transformers.pipeline("automatic-speech-recognition", model=str(folder),
                                                         device="cpu"), engine
    engine.stop()
    thread.join(60)
    assert not engine.alive


def transcribe(app, data: bytes, **fields) -> httpx.Response:
    return call(app, "POST", "/v1/audio/transcriptions", files={"file": ("clip.wav", data, "audio/wav")},
                data={"model": NAME, **fields})


def test_the_openai_client_gets_the_cpu_transcript_in_each_format(served):
    """The `openai` client's transcription (json), and text, verbose_json (timestamped segments), srt and vtt over
    raw requests: the CPU pipeline's text and chunks (greedy), a clip of 8 kHz resampled to 16 kHz first, and no
    graph compiled after the warm-up."""
    app, cpu, engine = served
    assert engine.max_new_tokens == GREEDY["generate_kwargs"]["max_new_tokens"]
    clip = wav(tones(4, seed=1))
    audio = read_audio(clip, 16000)
    expected = cpu(audio.copy(), **GREEDY)["text"]
    before = graphs()

    async def with_client() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http)
            return (await client.audio.transcriptions.create(model=NAME, file=("clip.wav", clip))).text

    assert asyncio.run(with_client()) == expected
    assert transcribe(app, clip, response_format="text").text == expected
    timed = cpu(audio.copy(), return_timestamps=True, **GREEDY)
    verbose = transcribe(app, clip, response_format="verbose_json").json()
    assert verbose["text"] == timed["text"] and verbose["duration"] == pytest.approx(4.0)
    assert [(s["start"], s["end"], s["text"]) for s in verbose["segments"]] == \
        [(*chunk["timestamp"], chunk["text"]) for chunk in timed["chunks"]]
    def clock(seconds: float, separator: str) -> str:
        milliseconds = round(seconds * 1000)
        return (f"{milliseconds // 3_600_000:02d}:{milliseconds // 60_000 % 60:02d}:{milliseconds // 1000 % 60:02d}"
                f"{separator}{milliseconds % 1000:03d}")

    cues = [(clock(s["start"], ","), clock(s["end"] or 4.0, ","), s["text"].strip()) for s in verbose["segments"]]
    assert cues and transcribe(app, clip, response_format="srt").text == "\n".join(
        f"{index + 1}\n{start} --> {end}\n{text}\n" for index, (start, end, text) in enumerate(cues))
    assert transcribe(app, clip, response_format="vtt").text == "WEBVTT\n\n" + "\n".join(
        f"{start.replace(',', '.')} --> {end.replace(',', '.')}\n{text}\n" for start, end, text in cues)
    slow = tones(4, seed=2, rate=8000)
    resampled = read_audio(wav(slow, 8000), 16000)
    assert len(resampled) == 2 * len(slow)
    assert transcribe(app, wav(slow, 8000)).json()["text"] == cpu(resampled, **GREEDY)["text"]
    assert graphs() == before


@pytest.mark.parametrize(("data", "fields", "status", "param"), [
    (b"not audio at all", {}, 400, "file"),
    (b"", {}, 400, "file"),
    (None, {"response_format": "xml"}, 400, "response_format"),
    (None, {"temperature": "1.5"}, 400, "temperature"),
    (None, {"model": "another-model"}, 404, "model"),
    (None, {"prompt": "earlier words"}, 400, "prompt"),
])
def test_bad_requests_are_refused_naming_the_field(served, data, fields, status, param):
    app, _, engine = served
    response = transcribe(app, wav(tones(1)) if data is None else data, **fields)
    assert response.status_code == status and response.json()["error"]["param"] == param, response.text
    assert engine.alive


def test_the_other_routes_say_what_this_server_serves(served):
    app, _, _ = served
    response = call(app, "POST", "/v1/chat/completions", json={"model": NAME, "messages": []})
    assert response.status_code == 404 and "/v1/audio/transcriptions" in response.json()["error"]["message"]
