"""The HTTP side of the server: FastAPI routes speaking the OpenAI API over a `GenerationEngine`, an
`EmbeddingEngine` or a `TranscriptionEngine`.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (streamed as server-sent events
ending with `data: [DONE]`, or whole) over a generation engine, with its LoRA adapters (named as
`model`; `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`, as vLLM's, when the engine has
`lora_adapters.AdapterSlots`), `POST /v1/embeddings` over an
embedding engine, `POST /v1/audio/transcriptions` over a transcription engine (see `transcriptions`;
each answering 404 over the others), `GET /v1/models`, `GET /v1/models/{id}`, `GET /health` (503
until every graph is compiled; then 200, counting the graphs not loaded yet), `GET /metrics`
(Prometheus, see `metrics`). With an API key, every route but `/health` wants
`Authorization: Bearer <key>`.
Request bodies above `max_body_bytes` are refused (413) before they are read whole.

An HTTP request is one engine request per choice: `n` per prompt, and a completion may batch
prompts (choice `i * n + j` is the `j`th of prompt `i`, as in the OpenAI API); with a `seed`, choice
`j` samples with `seed + j`. Each engine request goes to the engine's thread through
`Request.on_event`, which hands its events to the HTTP request's asyncio queue
(`call_soon_threadsafe`); a client that goes away cancels its requests, which leave their slots
before the next decode step. A request that fails in the engine ends its answer with an error
(a 500, or a last `data: {"error": ...}` event of its stream); the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types import Model
from starlette.exceptions import HTTPException

from ..errors import InvalidRequestError, ModelNotFoundError, ServerBusyError
from ..generation.engine import GenerationEngine
from ..generation.lora_adapters import AdapterSlots
from ..generation.requests import Event, SamplingSettings
from ..generation.requests import Request as EngineRequest
from . import answers
from .chat_images import chat_inputs
from .embedding_engine import EmbeddingEngine
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    error_body,
    parse,
)
from .structured_output import Grammars
from .tool_calls import ToolChoice, parser_of_template, tool_choice
from .transcriptions import TranscriptionEngine, transcription_routes

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DISCONNECT_POLL_SECONDS = 0.5  # how often a request waiting for its tokens checks that its client is still there
STARTING_RETRY_SECONDS = 5  # the Retry-After of a 503 while the graphs compile or load


def build_app(engine: GenerationEngine | EmbeddingEngine | TranscriptionEngine, model_name: str, *,
              api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              tool_parser: str | None = None, processor: Any = None) -> FastAPI:
    """The server's FastAPI application over `engine`, which the caller starts (`/health` answers 503
    until its graphs are ready); the application's shutdown stops it (letting the requests running
    finish).

    Args:
        engine (`GenerationEngine`): the engine.
        model_name (`str`): the name clients give as `model` (and `/v1/models` lists).
        api_key (`str`, *optional*): the key every route but `/health` wants.
        max_body_bytes (`int`): the largest request body taken.
        tool_parser (`str`, *optional*): how answers write their tool calls (`tool_calls.PARSERS`);
            default: the format the chat template's text names, if any.
        processor (`ProcessorMixin`, *optional*): a vision-language model's processor, which makes
            the prompts of chats (with their images, see `chat_images`).

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
    metrics = ServerMetrics(engine)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, error: InvalidRequestError) -> JSONResponse:
        return JSONResponse(error_body(str(error), "invalid_request_error", error.param), status_code=400)

    @app.exception_handler(ModelNotFoundError)
    async def model_not_found(request: Request, error: ModelNotFoundError) -> JSONResponse:
        return JSONResponse(error_body(str(error), "invalid_request_error", error.param, "model_not_found"),
                            status_code=404)

    @app.exception_handler(ServerBusyError)
    async def busy(request: Request, error: ServerBusyError) -> JSONResponse:
        if error.starting:
            return JSONResponse(error_body(str(error), "service_unavailable"), status_code=503,
                                headers={"Retry-After": str(STARTING_RETRY_SECONDS)})
        if error.retry_after is None:
            return JSONResponse(error_body(str(error), "service_unavailable"), status_code=503)
        return JSONResponse(error_body(str(error), "rate_limit_exceeded"), status_code=429,
                            headers={"Retry-After": str(error.retry_after)})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(error.detail), "invalid_request_error"), status_code=error.status_code,
                            headers=error.headers)

    @app.exception_handler(answers.RequestFailed)
    async def request_failed(request: Request, error: answers.RequestFailed) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {error}", "server_error"), status_code=500)

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

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    adapters = _adapters(engine)

    def listed() -> dict[str, dict[str, Any]]:  # (the model, and its adapters with their parent, as vLLM lists them)
        served = Model(id=model_name, created=created, object="model", owned_by="optimum-neuron-torch")
        names = dict(adapters.paths) if adapters is not None else {}
        return {model_name: served.model_dump(mode="json"),
                **{name: {**served.model_dump(mode="json"), "id": name, "root": path, "parent": model_name}
                   for name, path in names.items()}}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": list(listed().values())}

    @app.get("/v1/models/{name:path}")  # (a path: model names hold slashes, as Hub ids do)
    async def model(name: str) -> dict[str, Any]:
        known = listed()
        if name not in known:
            _check_model(name, model_name)
        return known[name]

    if isinstance(engine, EmbeddingEngine):
        _embedding_routes(app, engine, model_name, max_body_bytes)
    elif isinstance(engine, TranscriptionEngine):
        transcription_routes(app, engine, model_name, _check_model)
    else:
        _generation_routes(app, engine, model_name, max_body_bytes, metrics, tool_parser, processor)
    return app


def _generation_routes(app: FastAPI, engine: GenerationEngine, model_name: str, max_body_bytes: int,
                       metrics: ServerMetrics, tool_parser: str | None, processor: Any) -> None:
    """`POST /v1/chat/completions` and `POST /v1/completions` over a generation engine; `/v1/embeddings`
    answers 404 saying what serves it."""
    grammars = Grammars(engine.tokenizer, engine.model.get_input_embeddings().num_embeddings, engine.eos_token_ids)
    parser = tool_parser or parser_of_template(getattr(engine.tokenizer, "chat_template", None))
    adapters = _adapters(engine)

    def adapter_of(name: str) -> str | None:
        """The LoRA adapter a request naming `name` as its model runs with (None: the model itself)."""
        if name == model_name or adapters is None or name not in adapters.names:
            _check_model(name, model_name)
            return None
        return name

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = parse(await _read_body(request, max_body_bytes), ChatCompletionRequest)
        adapter = adapter_of(body.model)
        tools = body.tools_given()
        choice = tool_choice(tools, body.tool_choice_given(), parser, body.parallel_tool_calls is not False)
        grammar = _chat_grammar(grammars, body, tools, choice)
        prompt, images = _chat_prompt(engine, body, tools, processor)
        return await _respond(request, engine, metrics, grammars, body, [prompt], chat=True, grammar=grammar,
                              tools=choice, adapter=adapter, images=images)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = parse(await _read_body(request, max_body_bytes), CompletionRequest)
        adapter = adapter_of(body.model)
        prompts, texts = _token_lists(body.prompt, engine, "prompt")
        echoes = [engine.tokenizer.decode(ids) if text is None else text
                  for ids, text in zip(prompts, texts, strict=True)] if body.echo else None
        return await _respond(request, engine, metrics, grammars, body, prompts, chat=False, echoes=echoes,
                              grammar=grammars.grammar(body.response_format_given()), adapter=adapter)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = parse(await _read_body(request, max_body_bytes), LoadLoraAdapterRequest)
        if adapters is None:
            raise InvalidRequestError("this server serves no LoRA adapters: start it with --enable-lora", "lora_name")
        if body.lora_name == model_name:
            raise InvalidRequestError(f"{model_name!r} is the served model's name", "lora_name")
        await asyncio.to_thread(adapters.load, body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = parse(await _read_body(request, max_body_bytes), UnloadLoraAdapterRequest)
        if adapters is None:
            raise InvalidRequestError("this server serves no LoRA adapters: start it with --enable-lora", "lora_name")
        adapters.unload(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @app.post("/v1/embeddings")
    async def no_embeddings() -> None:
        raise HTTPException(404, "this server serves a generative model; /v1/embeddings is served by "
                                 "`optimum-cli neuron-torch serve --task embed` over an embedding model")


def _embedding_routes(app: FastAPI, engine: EmbeddingEngine, model_name: str, max_body_bytes: int) -> None:
    """`POST /v1/embeddings` over an embedding engine; the generation routes answer 404 saying why."""

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Any:
        body = parse(await _read_body(request, max_body_bytes), EmbeddingRequest)
        _check_model(body.model, model_name)
        if body.dimensions is not None and body.dimensions != engine.dimensions:
            raise InvalidRequestError(f"dimensions: this model's embeddings have {engine.dimensions}, not "
                                      f"{body.dimensions} (it does not shorten them)", "dimensions")
        inputs, _ = _token_lists(body.input, engine, "input")
        vectors = await asyncio.wrap_future(engine.submit(inputs))
        return JSONResponse(answers.embeddings(vectors, body.encoding_format, model_name,
                                               sum(map(len, inputs))).model_dump(mode="json"))

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def no_generation() -> None:
        raise HTTPException(404, "this server serves an embedding model (POST /v1/embeddings); chat and "
                                 "completions are served by `optimum-cli neuron-torch serve` over a generative model")


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


def _adapters(engine: GenerationEngine | EmbeddingEngine) -> AdapterSlots | None:
    """The LoRA adapters the engine serves, if any."""
    return getattr(getattr(engine, "device", None), "adapters", None)


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise ModelNotFoundError(f"model {name!r} is not served here; this server serves {served!r} (GET /v1/models)")


def _chat_prompt(engine: GenerationEngine, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                 processor: Any) -> tuple[list[int], Any]:
    """The prompt of the chat's messages, showing the model its `tools` (its chat template's way),
    and the pixel values of its images: by the `processor` of a vision-language model (see
    `chat_images`), else the tokenizer, which reads no image part."""
    if processor is not None:
        return chat_inputs(processor, body.messages, tools)
    image = next((f"messages.{index}.content.{part}" for index, message in enumerate(body.messages)
                  for part, _ in message.images()), None)
    if image is not None:
        raise InvalidRequestError(f"{image}: this model reads no images", image)
    tokenizer = engine.tokenizer
    if not tokenizer.chat_template:
        raise InvalidRequestError("this model's tokenizer has no chat template: use /v1/completions", "messages")
    messages = [message.for_template() for message in body.messages]
    encoding = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)
    return list(encoding["input_ids"]), None


def _chat_grammar(grammars: Grammars, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                  choice: ToolChoice | None) -> str | None:
    """The grammar the chat's answer is held to: its tool choice's (`required`, a named function), or
    its `response_format`'s, or None.

    Raises:
        InvalidRequestError: a tool's parameters that are no JSON schema, or a `response_format`
            beside a tool choice that holds the answer to a grammar (names the field).
    """
    for index, tool in enumerate(tools or []):  # (each tool's parameters: a JSON schema, whatever the choice)
        grammars.schema(tool["function"].get("parameters") or {"type": "object"}, f"tools.{index}.function.parameters",
                        for_answers=False)
    schema = choice.schema(tools) if choice is not None else None
    if schema is None:
        return grammars.grammar(body.response_format_given())
    if (body.response_format_given() or {}).get("type", "text") != "text":
        raise InvalidRequestError(f"response_format: the answer is held to the tool_choice {choice.mode}'s grammar; "
                                  "leave one of them out", "response_format")
    return grammars.schema(schema, "tool_choice")


def _token_lists(given: str | list[str] | list[int] | list[list[int]], engine: GenerationEngine | EmbeddingEngine,
                 field: str) -> tuple[list[list[int]], list[str | None]]:
    """The token ids of each text or list of token ids `given` (one, or a batch of them), and the
    text of each given as one.

    Raises:
        InvalidRequestError: a token id outside the model's vocabulary (names `field` and the index).
    """
    if not isinstance(given, list) or not given or not isinstance(given[0], (str, list)):
        given = [given]
    vocab = engine.model.get_input_embeddings().num_embeddings
    found = []
    for index, item in enumerate(given):
        if isinstance(item, str):
            found.append(list(engine.tokenizer(item).input_ids))
            continue
        if any(not 0 <= token < vocab for token in item):
            raise InvalidRequestError(f"token ids must be in [0, {vocab}), the model's vocabulary",
                                      field if len(given) == 1 else f"{field}.{index}")
        found.append(list(item))
    return found, [item if isinstance(item, str) else None for item in given]


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


def _engine_requests(engine: GenerationEngine, grammars: Grammars, body: ChatCompletionRequest | CompletionRequest,
                     prompts: list[list[int]], on_event: Callable[[int], Callable[[Event], None]],
                     grammar: str | None, adapter: str | None = None, images: Any = None) -> list[EngineRequest]:
    """An engine request per choice (`n` per prompt; with a `seed`, choice `j` samples with `seed + j`);
    held to a `grammar`, or with a `logit_bias`, each chooses its tokens on the host (`structured_output`);
    each with the LoRA adapter named `adapter`, if any, and the chat's `images` (pixel values), if any.

    Raises:
        InvalidRequestError: `n` beyond the slots, `echo` with `logprobs` on an engine that does not
            score prompts, or `ignore_eos` with a grammar (names the field).
    """
    n = body.n or 1
    if n > engine.batch_size:
        raise InvalidRequestError(f"n is {n}, above the {engine.batch_size} choices this server computes at once "
                                  "(its --batch-size)", "n")
    scored = body.prompt_logprobs_asked()
    if scored is not None and not engine.scoring:
        raise InvalidRequestError("echo with logprobs scores the prompt, which needs its own graphs: start the "
                                  "server with --prompt-logprobs", "echo")
    if grammar is not None and body.ignore_eos:
        raise InvalidRequestError("ignore_eos: an answer held to a response_format ends where its grammar does",
                                  "ignore_eos")
    sampling, eos = _sampling(engine, body), set() if body.ignore_eos else None
    bias = body.logit_bias_given(engine.model.get_input_embeddings().num_embeddings)
    jobs = []
    for index in range(len(prompts) * n):
        seed = sampling.seed if sampling.seed is None else (sampling.seed + index % n + 2**63) % 2**64 - 2**63
        prompt, own = prompts[index // n], dataclasses.replace(sampling, seed=seed)
        choose = None if grammar is None and bias is None else grammars.sampler(grammar, own, prompt, bias)
        # (chosen on the host, the row runs greedily on the device, its token not taken: the graphs of every row)
        device = own if choose is None else SamplingSettings(seed=seed)
        jobs.append(EngineRequest(prompt, body.max_new_tokens(), device, body.stop_strings(), on_event(index), eos,
                                  choose=choose,
                                  logprobs=body.logprobs_asked(), prompt_logprobs=scored, images=images))
        if adapter is not None:
            _adapters(engine).use(adapter, jobs[-1])
    return jobs


async def _respond(request: Request, engine: GenerationEngine, metrics: ServerMetrics, grammars: Grammars,
                   body: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]], chat: bool,
                   echoes: list[str] | None = None, grammar: str | None = None, tools: ToolChoice | None = None,
                   adapter: str | None = None, images: Any = None) -> Any:
    """Submits a request per choice to the engine and answers: streamed, or whole once they finish
    (each completion after its prompt's text, `echoes`, if given; each chat answer held to `grammar`,
    if given, its tool calls read as `tools` says; each with the LoRA adapter named `adapter`, if any)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
    n = body.n or 1
    jobs = _engine_requests(engine, grammars, body, prompts, lambda index: metrics.track(
        0 if index % n else len(prompts[index // n]), functools.partial(_put, loop, queue, index)), grammar,
                            adapter, images)
    try:
        for index, job in enumerate(jobs):
            field = "messages" if chat else "prompt" if len(prompts) == 1 else f"prompt.{index // n}"
            engine.submit(job, prompt_field=field)
    except BaseException:  # (nothing of a request half submitted stays)
        for job in jobs:
            engine.cancel(job)
        raise
    answer = answers.Answer(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), body.model,
                            len(jobs), sum(map(len, prompts)), functools.partial(answers.token_text, engine.tokenizer),
                            body.include_usage(), body.logprobs_asked() is not None,
                            None if echoes is None else [echoes[index // n] for index in range(len(jobs))], tools,
                            body.continuous_usage())
    events = _events(request, engine, jobs, queue, metrics.aborted)
    if body.stream:
        chunks = answer.chat_chunks(events) if chat else answer.completion_chunks(events)
        return StreamingResponse(answers.sse(chunks), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    response = await answer.whole(events, chat)
    if response is None:  # the client went away: nobody to answer
        return Response(status_code=499)  # (nginx's 499)
    return JSONResponse(response.model_dump(mode="json", exclude_unset=True))


def _put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[tuple[int, Event]], index: int, event: Event) -> None:
    """A choice's event, handed from the engine's thread to the HTTP request's queue."""
    loop.call_soon_threadsafe(queue.put_nowait, (index, event))


async def _events(request: Request, engine: GenerationEngine, jobs: list[EngineRequest],
                  queue: asyncio.Queue[tuple[int, Event]], aborted: Callable[[int], None] = lambda count: None
                  ) -> AsyncIterator[tuple[int, Event]]:
    """The (choice, event) pairs of the request's jobs until each has had its last; if the client goes
    away (or the response is abandoned), every job is cancelled, and `aborted` told how many had not
    finished."""
    running = len(jobs)
    try:
        while running:
            try:
                index, event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:  # (the builtin TimeoutError from Python 3.11 on, not before)
                if await request.is_disconnected():
                    return
                continue
            yield index, event
            running -= event.finish_reason is not None
    finally:
        for job in jobs:
            engine.cancel(job)
        if running:
            aborted(running)
