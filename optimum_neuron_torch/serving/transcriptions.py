"""Speech recognition behind a server's `POST /v1/audio/transcriptions` (the OpenAI audio API).

A speech recognition model (Whisper, or a CTC model such as wav2vec2) transcribes each uploaded file
through Transformers' speech recognition pipeline on the device (`optimum_neuron_torch.pipeline`):
Whisper's generation runs on its compiled graphs (see `generation.speech_graphs`), greedy, and audio
longer than 30 seconds is transcribed in 30-second chunks. A file is read as WAV (any sampling rate:
resampled to the model's with scipy's polyphase filter), or, with ffmpeg installed, in any format
ffmpeg reads.

One thread runs the device (`run`: the server's main thread, as the other engines'); requests come
from any thread (`submit`, a future) and are transcribed one at a time, in their order. The engine
compiles its graphs (batch bucket 1) before it serves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import logging
import math
import shutil
from dataclasses import dataclass
from typing import Any

import numpy
import scipy.io.wavfile
import scipy.signal
from fastapi import FastAPI, Form, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from transformers import Pipeline
from transformers.pipelines.audio_utils import ffmpeg_read

from ..errors import DEVICE_OR_JOB_FAILURES, InvalidRequestError
from .queued_engine import Job, QueuedEngine

logger = logging.getLogger(__name__)

MAX_AUDIO_BYTES = 25 * 1024 * 1024  # (the OpenAI API's limit on an uploaded file)
CHUNK_SECONDS = 30  # (Whisper's window: longer audio is transcribed in chunks of it)
RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
MAX_NEW_TOKENS = 256  # (per 30-second window: Transformers' speech recognition pipeline's default)
PROMPT_ROOM = 16  # (decoder positions kept for Whisper's start, language, task and timestamp tokens)


def read_audio(data: bytes, rate: int) -> numpy.ndarray:
    """The samples of an uploaded file, mono float32 at `rate` Hz.

    Raises:
        InvalidRequestError: the file is empty, or neither WAV nor (with ffmpeg) another audio
            format (names `file`, and what the reader said).
    """
    if not data:
        raise InvalidRequestError("file: the uploaded file is empty", "file")
    try:
        file_rate, samples = scipy.io.wavfile.read(io.BytesIO(data))
    except ValueError as error:
        if shutil.which("ffmpeg") is None:
            raise InvalidRequestError(f"file: not a WAV file ({error}); this server reads other audio formats "
                                      "with ffmpeg, which is not installed", "file") from None
        try:
            return ffmpeg_read(data, rate)
        except ValueError as ffmpeg_error:
            raise InvalidRequestError(f"file: ffmpeg cannot read it as audio ({ffmpeg_error})", "file") from None
    # Integers are scaled to [-1, 1] before the channels are averaged: their mean is a float and would
    # no longer say which integer width it came from.
    if samples.dtype == numpy.uint8:  # (8-bit WAV is unsigned)
        samples = (samples.astype(numpy.float32) - 128) / 128
    elif samples.dtype.kind == "i":
        samples = samples.astype(numpy.float32) / numpy.iinfo(samples.dtype).max
    samples = samples.astype(numpy.float32)
    if samples.ndim == 2:  # (channels: their mean)
        samples = samples.mean(axis=1)
    if file_rate != rate:  # (resampled by the ratio of the two rates)
        common = math.gcd(file_rate, rate)
        samples = scipy.signal.resample_poly(samples, rate // common, file_rate // common).astype(numpy.float32)
    return samples


@dataclass(frozen=True)
class Transcription:
    """What a request asks: its audio (at the model's rate), the language (Whisper), the temperature
    (0: greedy), and whether it wants timestamped segments."""

    audio: numpy.ndarray
    language: str | None = None
    temperature: float = 0.0
    segments: bool = False


class TranscriptionEngine(QueuedEngine):
    """Transcribes audio with a speech recognition pipeline on the device (see the module's docstring).

    Args:
        pipeline (`Pipeline`): Transformers' speech recognition pipeline over a model on the device
            (`optimum_neuron_torch.pipeline("automatic-speech-recognition", model)`).

    Example:

    ```python
    >>> engine = TranscriptionEngine(optimum_neuron_torch.pipeline("automatic-speech-recognition", folder))
    >>> engine.start()
    >>> engine.wait_ready()
    >>> engine.submit(Transcription(samples)).result()["text"]
    ```
    """

    name = "transcription"
    jobs_per_turn = 1  # (one file at a time, in their order)

    def __init__(self, pipeline: Pipeline) -> None:
        super().__init__(pipeline.model)
        self.pipeline = pipeline
        self.rate: int = pipeline.feature_extractor.sampling_rate
        self.generates = self.model.config.is_encoder_decoder  # (Whisper; a CTC model reads its logits)
        positions = getattr(self.model.config, "max_target_positions", MAX_NEW_TOKENS + PROMPT_ROOM)
        self.max_new_tokens = min(MAX_NEW_TOKENS, positions - PROMPT_ROOM)  # (per window)

    def submit(self, request: Transcription) -> concurrent.futures.Future:
        """Queues a transcription: a future of the pipeline's output (`text`, and `chunks` with
        timestamps if `request.segments`).

        Raises:
            ServerBusyError: the engine is not serving (starting, stopping or failed).
        """
        return self.enqueue(request)

    def warm_up(self, show_progress: bool) -> None:
        """Compiles (or loads) Whisper's two graphs of batch 1 (a CTC model runs eagerly)."""
        if hasattr(self.model, "precompile"):
            self.model.precompile(batch_sizes=(1,), show_progress=show_progress)

    def serve(self, jobs: list[Job]) -> None:
        """Transcribes one request; its own failure fails it alone, the device's stops the engine."""
        ((request, future),) = jobs
        self.busy_slots = 1
        try:
            future.set_result(self.pipeline({"raw": request.audio, "sampling_rate": self.rate},
                                            **self._arguments(request)))
        except DEVICE_OR_JOB_FAILURES as error:
            future.set_exception(self.stopped(error))
            raise
        except Exception as error:
            logger.exception("a transcription failed")
            future.set_exception(error)
        finally:
            self.busy_slots = 0

    def _arguments(self, request: Transcription) -> dict[str, Any]:
        """The pipeline's arguments for `request`: chunks past 30 seconds, timestamps if asked, and
        for Whisper its generation's (greedy, or sampled at the temperature; language)."""
        arguments: dict[str, Any] = {}
        if len(request.audio) > CHUNK_SECONDS * self.rate:
            arguments["chunk_length_s"] = CHUNK_SECONDS
        if request.segments:
            arguments["return_timestamps"] = True if self.generates else "word"
        if self.generates:
            generation: dict[str, Any] = {"num_beams": 1, "max_new_tokens": self.max_new_tokens}
            if request.temperature > 0:
                generation.update(do_sample=True, temperature=request.temperature)
            if request.language is not None:
                generation["language"] = request.language
            arguments["generate_kwargs"] = generation
        return arguments


def transcription_routes(app: FastAPI, engine: TranscriptionEngine, model_name: str, check_model: Any) -> None:
    """`POST /v1/audio/transcriptions` over a transcription engine (multipart: `file`, `model`,
    `language`, `response_format`, `temperature`; `prompt` is refused, not supported yet); the chat,
    completions and embeddings routes answer 404 saying why."""

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(file: UploadFile, model: str = Form(...), language: str | None = Form(None),
                             prompt: str | None = Form(None), response_format: str = Form("json"),
                             temperature: float = Form(0.0)) -> Response:
        check_model(model, model_name)
        if prompt:
            raise InvalidRequestError("prompt: not supported by this server yet", "prompt")
        if response_format not in RESPONSE_FORMATS:
            raise InvalidRequestError(f"response_format: {response_format!r} is not one of "
                                      f"{', '.join(RESPONSE_FORMATS)}", "response_format")
        if not 0 <= temperature <= 1:
            raise InvalidRequestError(f"temperature: {temperature} is not between 0 and 1", "temperature")
        data = await file.read(MAX_AUDIO_BYTES + 1)
        if len(data) > MAX_AUDIO_BYTES:
            raise HTTPException(413, f"file: above {MAX_AUDIO_BYTES} bytes")
        audio = read_audio(data, engine.rate)
        timed = response_format in ("verbose_json", "srt", "vtt")
        request = Transcription(audio, language, temperature, segments=timed)
        output = await asyncio.wrap_future(engine.submit(request))
        return _answer(output, response_format, len(audio) / engine.rate, language)

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    @app.post("/v1/embeddings")
    async def not_transcriptions() -> None:
        raise HTTPException(404, "this server serves a speech recognition model (POST /v1/audio/transcriptions)")


def _answer(output: dict[str, Any], response_format: str, duration: float, language: str | None) -> Response:
    """The response of `response_format` for the pipeline's `output`."""
    text = output["text"]
    segments = [{"id": index, "start": chunk["timestamp"][0], "end": chunk["timestamp"][1], "text": chunk["text"]}
                for index, chunk in enumerate(output.get("chunks", []))]
    if response_format == "json":
        return JSONResponse({"text": text})
    if response_format == "text":
        return PlainTextResponse(text)
    if response_format == "verbose_json":
        return JSONResponse({"task": "transcribe", "language": language, "duration": duration, "text": text,
                             "segments": segments})
    separator, header = ("," if response_format == "srt" else "."), ("" if response_format == "srt" else "WEBVTT\n\n")
    cues = [(f"{index + 1}\n" if response_format == "srt" else "")
            + f"{_clock(segment['start'], separator)} --> {_clock(segment['end'] or duration, separator)}\n"
            + f"{segment['text'].strip()}\n" for index, segment in enumerate(segments)]
    return PlainTextResponse(header + "\n".join(cues))


def _clock(seconds: float, separator: str) -> str:
    """`seconds` as hours:minutes:seconds{separator}milliseconds (SubRip uses a comma, WebVTT a dot)."""
    milliseconds = round(seconds * 1000)
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    return f"{hours:02d}:{minutes:02d}:{milliseconds // 1000:02d}{separator}{milliseconds % 1000:03d}"
