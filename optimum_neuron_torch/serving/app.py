"""The HTTP side of the server: FastAPI routes speaking the OpenAI API over a `GenerationEngine`.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (streamed as server-sent events
ending with `data: [DONE]`, or whole), `GET /v1/models`, `GET /health` (503 until every graph is
compiled; then 200, counting the graphs not loaded yet). With an API key, every route but `/health`
wants `Authorization: Bearer <key>`.
Request bodies above `max_body_bytes` are refused (413) before they are read whole.

Each request goes to the engine's thread through `Request.on_event`, which hands its events to the
request's asyncio queue (`call_soon_threadsafe`); a client that goes away cancels its request,
which leaves its slot before the next decode step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from starlette.exceptions import HTTPException

from ..errors import InvalidRequestError, ServerBusyError
from ..generation.engine import GenerationEngine
from ..generation.requests import Event, SamplingSettings
from ..generation.requests import Request as EngineRequest
from .protocol import ChatCompletionRequest, CompletionRequest, error_body, parse

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DISCONNECT_POLL_SECONDS = 0.5  # how often a request waiting for its tokens checks that its client is still there


def build_app(engine: GenerationEngine, model_name: str, *, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The server's FastAPI application over `engine`, which the caller starts (`/health` answers 503
    until its graphs are ready); the application's shutdown stops it (letting the requests running
    finish).

    Args:
        engine (`GenerationEngine`): the engine.
        model_name (`str`): the name clients give as `model` (and `/v1/models` lists).
        api_key (`str`, *optional*): the key every route but `/health` wants.
        max_body_bytes (`int`): the largest request body taken.

    Example:

    ```python
    >>> import uvicorn
    >>> engine = GenerationEngine(model, tokenizer)
    >>> engine.start()
    >>> uvicorn.run(build_app(engine, "my-model"), host="127.0.0.1", port=8000)
    ```
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(engine.stop)

    async def authorize(request: Request) -> None:
        if api_key is not None and request.url.path != "/health":
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), api_key.encode()):
                raise HTTPException(401, "missing or wrong API key: send the header `Authorization: Bearer <key>`")

    # (a dependency rather than a middleware: Starlette's middlewares wrap the streams of the responses)
    app = FastAPI(title="optimum-neuron-torch", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(authorize)])
    created = int(time.time())

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, error: InvalidRequestError) -> JSONResponse:
        return JSONResponse(error_body(str(error), "invalid_request_error", error.param), status_code=400)

    @app.exception_handler(ServerBusyError)
    async def busy(request: Request, error: ServerBusyError) -> JSONResponse:
        if error.retry_after is None:
            return JSONResponse(error_body(str(error), "service_unavailable"), status_code=503)
        return JSONResponse(error_body(str(error), "rate_limit_exceeded"), status_code=429,
                            headers={"Retry-After": str(error.retry_after)})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(error.detail), "invalid_request_error"), status_code=error.status_code,
                            headers=error.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(error).__name__}: {error}", "server_error"),
                            status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.ready.is_set() and engine.alive:
            return JSONResponse({"status": "ok", "device_memory_allocated": engine.device_memory(),
                                 "running": engine.busy_slots, "waiting": engine.waiting,
                                 "graphs_unloaded": engine.graphs_unloaded})
        status = "failed" if engine.failure is not None else "stopped" if engine.ready.is_set() else "loading"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = Model(id=model_name, created=created, object="model", owned_by="optimum-neuron-torch")
        return {"object": "list", "data": [model.model_dump(mode="json")]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = parse(await _read_body(request, max_body_bytes), ChatCompletionRequest)
        _check_model(body.model, model_name)
        prompt = _chat_prompt(engine, body)
        return await _respond(request, engine, body, prompt, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = parse(await _read_body(request, max_body_bytes), CompletionRequest)
        _check_model(body.model, model_name)
        return await _respond(request, engine, body, _completion_prompt(engine, body), chat=False)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) once it passes `limit` bytes, without reading further."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"the request body has {declared} bytes, above this server's {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"the request body is above this server's {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise InvalidRequestError(f"model {name!r} is not served here; this server serves {served!r} "
                                  "(GET /v1/models)", "model")


def _chat_prompt(engine: GenerationEngine, body: ChatCompletionRequest) -> list[int]:
    tokenizer = engine.tokenizer
    if not tokenizer.chat_template:
        raise InvalidRequestError("this model's tokenizer has no chat template: use /v1/completions", "messages")
    messages = [{"role": message.role, "content": message.text()} for message in body.messages]
    encoding = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoding["input_ids"])


def _completion_prompt(engine: GenerationEngine, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise InvalidRequestError(f"one prompt per request, got {len(prompt)}", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(engine.tokenizer(prompt).input_ids)
    vocab = engine.model.get_input_embeddings().num_embeddings
    if any(not 0 <= token < vocab for token in prompt):
        raise InvalidRequestError(f"token ids must be in [0, {vocab}), the model's vocabulary", "prompt")
    return list(prompt)


def _sampling(engine: GenerationEngine, body: ChatCompletionRequest | CompletionRequest) -> SamplingSettings:
    """The request's sampling; what it leaves out comes from the model's generation config (greedy
    if that does not sample; its repetition penalty applies either way, as in Transformers)."""
    config = engine.model.generation_config
    sampled = bool(config.do_sample)

    def given(value: Any, configured: Any, off: Any) -> Any:
        return value if value is not None else (configured or off) if sampled else off

    temperature = body.temperature if body.temperature is not None else (config.temperature or 1.0) if sampled else 0.0
    return SamplingSettings(
        temperature=float(temperature),
        top_p=float(given(body.top_p, config.top_p, 1.0)),
        top_k=max(int(given(body.top_k, config.top_k, 0)), 0),
        min_p=float(given(body.min_p, config.min_p, 0.0)),
        repetition_penalty=float(body.repetition_penalty or config.repetition_penalty or 1.0),
        presence_penalty=float(body.presence_penalty or 0.0),
        frequency_penalty=float(body.frequency_penalty or 0.0),
        seed=body.seed)


async def _respond(request: Request, engine: GenerationEngine, body: ChatCompletionRequest | CompletionRequest,
                   prompt: list[int], chat: bool) -> Any:
    """Submits the request to the engine and answers: streamed, or whole once it finishes."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()
    job = EngineRequest(prompt, body.max_new_tokens(), _sampling(engine, body), body.stop_strings(),
                        lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
    engine.submit(job, prompt_field="messages" if chat else "prompt")
    identity = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    events = _events(request, engine, job, queue)
    if body.stream:
        chunks = _chat_chunks if chat else _completion_chunks
        return StreamingResponse(_sse(chunks(events, identity, created, body.model, len(prompt),
                                             body.include_usage())),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    text, last = [], None
    async for event in events:
        text.append(event.text)
        last = event
    if last is None or last.finish_reason is None:  # the client went away: nobody to answer (nginx's 499)
        return Response(status_code=499)
    finish, usage = _finish(last), _usage(len(prompt), last)
    if chat:
        message = ChatCompletionMessage(role="assistant", content="".join(text))
        response = ChatCompletion(id=identity, created=created, model=body.model, object="chat.completion",
                                  choices=[ChatChoice(index=0, message=message, finish_reason=finish)], usage=usage)
    else:
        choice = CompletionChoice(index=0, text="".join(text), finish_reason=finish)
        response = Completion(id=identity, created=created, model=body.model, object="text_completion",
                              choices=[choice], usage=usage)
    return JSONResponse(response.model_dump(mode="json", exclude_unset=True))


async def _events(request: Request, engine: GenerationEngine, job: EngineRequest,
                  queue: asyncio.Queue[Event]) -> AsyncIterator[Event]:
    """The request's events until its last; if its client goes away (or the response is
    abandoned), the request is cancelled."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:  # (the builtin TimeoutError from Python 3.11 on, not before)
                if await request.is_disconnected():
                    return
                continue
            yield event
            if event.finish_reason is not None:
                return
    finally:
        engine.cancel(job)


async def _chat_chunks(events: AsyncIterator[Event], identity: str, created: int, model: str, prompt_tokens: int,
                       include_usage: bool) -> AsyncIterator[ChatCompletionChunk]:
    def chunk(delta: ChoiceDelta | None, finish: str | None = None,
              usage: CompletionUsage | None = None) -> ChatCompletionChunk:
        choices = [] if delta is None else [ChunkChoice(index=0, delta=delta, finish_reason=finish)]
        return ChatCompletionChunk(id=identity, created=created, model=model, object="chat.completion.chunk",
                                   choices=choices, **({"usage": usage} if usage else {}))

    yield chunk(ChoiceDelta(role="assistant", content=""))
    async for event in events:
        if event.text:
            yield chunk(ChoiceDelta(content=event.text))
        if event.finish_reason is not None:
            yield chunk(ChoiceDelta(), _finish(event))
            if include_usage:
                yield chunk(None, usage=_usage(prompt_tokens, event))


async def _completion_chunks(events: AsyncIterator[Event], identity: str, created: int, model: str,
                             prompt_tokens: int, include_usage: bool) -> AsyncIterator[Completion]:
    def chunk(text: str | None, finish: str | None = None, usage: CompletionUsage | None = None) -> Completion:
        # (`model_construct`: the `openai` type wants a finish reason, which a chunk before the last has not)
        choices = [] if text is None else [CompletionChoice.model_construct(index=0, text=text, logprobs=None,
                                                                            finish_reason=finish)]
        return Completion(id=identity, created=created, model=model, object="text_completion", choices=choices,
                          **({"usage": usage} if usage else {}))

    async for event in events:
        if event.text or event.finish_reason is not None:
            yield chunk(event.text, event.finish_reason and _finish(event))
        if event.finish_reason is not None and include_usage:
            yield chunk(None, usage=_usage(prompt_tokens, event))


def _finish(event: Event) -> str:
    if event.finish_reason == "error":
        raise RuntimeError(f"the serving engine failed during this request: {event.error or 'the engine stopped'}")
    return event.finish_reason


def _usage(prompt_tokens: int, event: Event) -> CompletionUsage:
    return CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=event.completion_tokens,
                           total_tokens=prompt_tokens + event.completion_tokens)


async def _sse(chunks: AsyncIterator[ChatCompletionChunk | Completion]) -> AsyncIterator[str]:
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]`."""
    async for chunk in chunks:
        yield f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
    yield "data: [DONE]\n\n"
