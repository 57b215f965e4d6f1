"""The server in process (`serving.protocol`, `serving.app`, `serving.server`) for mutation testing: mutmut reruns
these on each mutant, and a subprocess would import the unmutated package. Pure functions and the application over a
scripted engine; one tiny compiled engine (2 slots, 8 graphs) answers with Transformers' greedy tokens on the CPU."""

from __future__ import annotations

import asyncio
import collections
import json
import re
import shutil
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
import transformers
import uvicorn
from openai.types import CompletionUsage
from starlette.testclient import TestClient

import optimum_neuron_torch as ont
from optimum_neuron_torch.compiler import cache_stats, reset_cache_stats
from optimum_neuron_torch.compiler.cache import SLOTS_DIR, CompileCache
from optimum_neuron_torch.errors import InvalidRequestError, ModelNotFoundError, ServerBusyError
from optimum_neuron_torch.generation.buckets import Buckets, engine_plan
from optimum_neuron_torch.generation.engine import GenerationEngine
from optimum_neuron_torch.generation.requests import Event, Request, SamplingSettings, TokenLogprob
from optimum_neuron_torch.serving import answers
from optimum_neuron_torch.serving import app as serving
from optimum_neuron_torch.serving.app import build_app
from optimum_neuron_torch.serving.metrics import ServerMetrics
from optimum_neuron_torch.serving.protocol import ChatCompletionRequest, CompletionRequest, _type_tag, error_body
from optimum_neuron_torch.serving.server import run_server
from optimum_neuron_torch.serving.structured_output import Grammars
from optimum_neuron_torch.settings import COMPILE_CACHE_ENV
from tiny_models import VOCAB, chat_tokenizer, greedy_answer, noisy_llama, tiny_tokenizer

NAME = "tiny-llama"
USER = [{"role": "user", "content": "what is the capital of france?"}]
TOKENIZER = chat_tokenizer()
CHAT_IDS = TOKENIZER.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=True).input_ids
EVENTS = [Event("he", 1), Event("", 2), Event(" llo", 3, "stop")]  # what the scripted engine answers
CHAT_ID, COMPLETION_ID = "chatcmpl-[0-9a-f]{32}", "cmpl-[0-9a-f]{32}"


def chat(**fields) -> dict:
    return {"model": NAME, "messages": USER, **fields}


def parse(data: dict | bytes, request_type=ChatCompletionRequest):
    return serving.parse(data if isinstance(data, bytes) else json.dumps(data).encode(), request_type)


def refusal(data: dict | bytes, request_type=ChatCompletionRequest) -> tuple[str | None, str]:
    with pytest.raises(InvalidRequestError) as caught:
        parse(data, request_type)
    return caught.value.param, str(caught.value)


class ScriptedEngine:
    """The engine as the application sees it, without a model: `submit` checks a request, keeps it, answers."""

    def __init__(self, events=EVENTS, busy=None, ready=True, alive=True, failure=None, tokenizer=TOKENIZER):
        self.events, self.busy, self.alive, self.failure, self.tokenizer = events, busy, alive, failure, tokenizer
        self.model = SimpleNamespace(generation_config=transformers.GenerationConfig(),
                                     get_input_embeddings=lambda: torch.nn.Embedding(VOCAB, 1))
        self.ready, self.busy_slots, self.waiting, self.jobs, self.cancelled = threading.Event(), 1, 2, [], []
        self.graphs_unloaded, self.batch_size, self.busy_after, self.scoring = 3, 2, None, False
        self.eos_token_ids = {TOKENIZER.eos_token_id}
        self.ready.set() if ready else None
        self.device_memory, self.cancel, self.stop = lambda: 123, self.cancelled.append, self.ready.clear

    def submit(self, job, prompt_field="prompt") -> None:
        job.check(64, prompt_field, self.scoring)
        if self.busy and (self.busy_after is None or len(self.jobs) >= self.busy_after):
            raise self.busy
        self.jobs.append((job, prompt_field))
        for event in self.events:
            job.on_event(event)


def call(app, method: str, path: str, raise_app_exceptions: bool = False, **kwargs) -> httpx.Response:
    async def send() -> httpx.Response:  # (by default, the 500 answering an exception, rather than the exception)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as http:
            return await http.request(method, path, **kwargs)

    return asyncio.run(send())


def sse(response: httpx.Response) -> list[dict]:
    """The chunks of a streamed answer, checking its framing (`data: ...` events, then `data: [DONE]`)."""
    headers, frames = response.headers, response.text.split("\n\n")
    assert headers["content-type"].startswith("text/event-stream") and headers["cache-control"] == "no-cache"
    assert frames[-2:] == ["data: [DONE]", ""] and all(frame.startswith("data: {") for frame in frames[:-2])
    return [json.loads(frame.removeprefix("data: ")) for frame in frames[:-2]]


def test_parse_reads_the_fields_and_refuses_bad_ones_naming_them():
    for fields, param in [
        ({"model": 1}, "model"), ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"), ({"n": 0}, "n"),
        ({"n": 2**31}, "n"), ({"top_k": 2**31}, "top_k"), ({"ignore_eos": 1}, "ignore_eos"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"), ({"top_k": -2}, "top_k"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages.0.content"),
        ({"max_tokens": "10"}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"seed": 2**63}, "seed"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"stop": 1}, "stop"), ({"stream": "yes"}, "stream"),
        ({"temperature": 2.5}, "temperature"), ({"top_p": 0}, "top_p"), ({"presence_penalty": 3}, "presence_penalty"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ]:
        field, message = refusal(chat(**fields))
        assert field == param and message.startswith(f"{param}: "), message
    for data, message in [(b'{"model": ', "is not valid JSON: Expecting"), (b"\xff", "is not valid JSON: 'utf-8'"),
                          (b"[1]", "must be a JSON object, got list"), (b'"stop"', "must be a JSON object, got str")]:
        assert refusal(data)[0] is None and refusal(data)[1].startswith(f"the request body {message}"), refusal(data)
    assert [refusal({"messages": USER}), refusal({"model": NAME})] == [
        ("model", "model: Field required"), ("messages", "messages: Field required")]
    for fields in (dict(echo=True), dict(logprobs=None, echo=0), dict(functions=[{"name": "f"}])):
        name = next(name for name, value in fields.items() if value is not None)
        assert refusal(chat(**fields)) == (name, f"{name} is not supported by this server; leave it out")
    for fields, param in [(dict(logprobs=1), "logprobs"), (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
                          (dict(top_logprobs=-1), "top_logprobs")]:
        assert refusal(chat(**fields))[0] == param
    assert refusal({"model": NAME, "prompt": "a", "logprobs": 21}, CompletionRequest)[0] == "logprobs"
    assert refusal({"model": NAME, "prompt": "a", "logprobs": True}, CompletionRequest)[0] == "logprobs"
    asked = [parse(chat(**fields)).logprobs_asked() for fields in (
        {}, dict(logprobs=False), dict(logprobs=True), dict(logprobs=True, top_logprobs=3), dict(top_logprobs=0))]
    assert asked == [None, None, 0, 3, None]
    with pytest.raises(InvalidRequestError, match=r"^top_logprobs needs logprobs: true$"):
        parse(chat(top_logprobs=2)).logprobs_asked()
    assert parse({"model": NAME, "prompt": "a", "logprobs": 0}, CompletionRequest).logprobs_asked() == 0
    scored = [parse({"model": NAME, "prompt": "a", **fields}, CompletionRequest).prompt_logprobs_asked()
              for fields in ({}, dict(echo=True), dict(logprobs=2), dict(echo=True, logprobs=0),
                             dict(echo=True, logprobs=3))]
    assert scored == [None, None, None, 0, 3] and parse(chat(logprobs=True)).prompt_logprobs_asked() is None
    assert refusal({"model": NAME, "prompt": "a", "echo": 1}, CompletionRequest)[0] == "echo"
    for response_format, param in [({"type": "xml"}, "response_format.type"), ({}, "response_format.type"),
                                   ({"type": "json_schema", "json_schema": {}}, "response_format.json_schema.name"),
                                   ({"type": "json_schema", "json_schema": {"name": "a", "schema": []}},
                                    "response_format.json_schema.schema")]:
        assert refusal(chat(response_format=response_format))[0] == param
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert [parse(chat(**fields)).response_format_given() for fields in (
        {}, dict(response_format={"type": "json_object"}),
        dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}))
    ] == [None, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                                                                                  "strict": True}}]
    body = parse(chat(max_tokens=5, temperature=0.5, top_p=0.9, top_k=-1, seed=-(2**63), stop=list("abcd"),
                      stream=True, stream_options={"include_usage": True}, logprobs=False, echo=False, tools=[]))
    assert (body.model, body.max_tokens, body.temperature, body.top_p, body.top_k, body.seed, body.stream) == (
        NAME, 5, 0.5, 0.9, -1, -(2**63), True)
    assert (body.stop_strings(), body.include_usage(), body.max_new_tokens()) == (list("abcd"), True, 5)
    body = parse(chat(stop="x y", max_tokens=5, max_completion_tokens=7, logprobs=False, best_of=1))
    assert (body.stop_strings(), body.include_usage(), body.max_new_tokens()) == (["x y"], False, 7)
    body = parse(chat(stream_options={"include_usage": False}))
    assert (body.stop_strings(), body.include_usage(), body.max_new_tokens()) == ([], False, None)
    with pytest.raises(InvalidRequestError, match=r"^at most 4 stop strings, got 5$") as caught:
        parse(chat(stop=list("abcde"))).stop_strings()
    assert caught.value.param == "stop" and parse(chat()).messages[0].text() == USER[0]["content"]
    parts = [{"type": "text", "text": "what is "}, {"type": "text", "text": "it?"}]
    assert parse(chat(messages=[{"role": "user", "content": parts}])).messages[0].text() == "what is it?"
    assert [parse({"model": NAME, "prompt": [1, 2], **fields}, CompletionRequest).max_new_tokens()
            for fields in ({}, {"max_tokens": 3})] == [16, 3]  # (the OpenAI API's default: 16)
    assert refusal({"model": NAME, "prompt": [1.5]}, CompletionRequest)[0] == "prompt"


def test_type_tags_error_body_check_model_finish_usage_and_sampling_from_the_body_then_the_config():
    tags = ("str", "int", "float", "bool", "list[int]", "function-after[f]", "messages", 0, "content")
    assert [_type_tag(tag) for tag in tags] == [True] * 6 + [False] * 3
    assert error_body("m", "k", "p") == {"error": {"message": "m", "type": "k", "param": "p", "code": None}}
    serving._check_model(NAME, NAME)
    with pytest.raises(ModelNotFoundError, match=r"^model 'other' is not served here; this server serves "
                                                 r"'tiny-llama' \(GET /v1/models\)$") as caught:
        serving._check_model("other", NAME)
    assert caught.value.param == "model"
    assert [answers.finish(Event("", 1, reason)) for reason in ("stop", "length")] == ["stop", "length"]
    with pytest.raises(RuntimeError, match=r"^the serving engine failed during this request: the engine stopped$"):
        answers.finish(Event("", 1, "error"))
    assert answers.usage(4, [Event("", 3), Event("", 2, "stop")]) == CompletionUsage(
        prompt_tokens=4, completion_tokens=5, total_tokens=9)

    def sampling(config, **fields) -> SamplingSettings:
        return serving._sampling(SimpleNamespace(model=SimpleNamespace(generation_config=config)),
                                 parse(chat(**fields)))

    greedy = transformers.GenerationConfig(top_k=50, top_p=0.5, repetition_penalty=1.2)  # (does not sample)
    assert sampling(greedy) == SamplingSettings(0.0, 1.0, 0, 0.0, 1.2, 0.0, 0.0, None)
    given = dict(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5,
                 frequency_penalty=-0.5, seed=3)
    sampled = SimpleNamespace(do_sample=True, temperature=0.6, top_p=0.8, top_k=20, min_p=0.5, repetition_penalty=None)
    assert sampling(greedy, **given) == sampling(sampled, **given) == SamplingSettings(**given)
    assert sampling(sampled) == SamplingSettings(0.6, 0.8, 20, 0.5, 1.0, 0.0, 0.0, None)
    assert sampling(sampled, temperature=0, top_k=-1) == SamplingSettings(0.0, 0.8, 0, 0.5)
    unset = SimpleNamespace(**{name: None for name in vars(sampled)} | {"do_sample": True})
    assert sampling(unset) == SamplingSettings(1.0, 1.0, 0, 0.0, 1.0, 0.0, 0.0, None)


def test_events_end_at_the_last_one_of_every_choice_or_when_the_client_goes_and_cancel_the_requests(monkeypatch):
    monkeypatch.setattr(serving, "DISCONNECT_POLL_SECONDS", 0.01)
    engine, job, jobs, aborts = ScriptedEngine(), object(), [object(), object()], []

    async def run(events: list[tuple[int, Event]], gone_after: int, choices: tuple = (job,)) -> list:
        queue, polls = asyncio.Queue(), []
        for event in events:
            queue.put_nowait(event)

        async def is_disconnected() -> bool:
            polls.append(True)
            if len(polls) == 1:
                queue.put_nowait((0, Event("late", 1, "stop")))  # (arrives after a poll that found the client there)
            return len(polls) > gone_after

        client = SimpleNamespace(is_disconnected=is_disconnected)
        return [event async for event in serving._events(client, engine, list(choices), queue, aborts.append)]

    assert asyncio.run(run([(0, Event("a", 1)), (0, Event("b", 2, "length")), (0, Event("c", 3))], 0)) == [
        (0, Event("a", 1)), (0, Event("b", 2, "length"))]
    assert asyncio.run(run([], 0)) == []  # (the client went: no event)
    assert asyncio.run(run([], 1)) == [(0, Event("late", 1, "stop"))]
    two = [(1, Event("a", 1)), (1, Event("b", 2, "stop")), (0, Event("c", 1, "length")), (0, Event("d", 2))]
    assert asyncio.run(run(two, 0, tuple(jobs))) == two[:3]  # (until each choice had its last event)
    assert engine.cancelled == [job] * 3 + jobs
    assert aborts == [1]  # (the client that went before any event: its choice had not finished)

    async def left(events: list[Event]):  # a client that goes before its whole answer: nobody to answer
        async def is_disconnected() -> bool:
            return True

        client = SimpleNamespace(is_disconnected=is_disconnected)
        engine = ScriptedEngine(events)
        grammars, metrics = Grammars(TOKENIZER, VOCAB, engine.eos_token_ids), ServerMetrics(engine)
        response = await serving._respond(client, engine, metrics, grammars, parse(chat(n=2)), [CHAT_IDS], chat=True)
        return response.status_code, metrics.registry.get_sample_value(
            "optimum_neuron_torch:request_success_total", {"finished_reason": "abort"}) or 0

    assert [asyncio.run(left(events)) for events in ([], EVENTS[:1])] == [(499, 2), (499, 2)]  # (both choices)
    assert asyncio.run(left(EVENTS)) == (200, 0)  # (finished before anyone asked)


class SlowEngine(ScriptedEngine):
    """Answers from another thread, a while after the request: the application waits, asking its client."""

    def submit(self, job, prompt_field="prompt") -> None:
        events, self.events = self.events, []
        super().submit(job, prompt_field)
        threading.Timer(0.05, lambda: [job.on_event(event) for event in events]).start()


def test_a_request_waiting_for_its_answer_asks_whether_its_client_is_there(monkeypatch):
    monkeypatch.setattr(serving, "DISCONNECT_POLL_SECONDS", 0.01)  # (several polls before the answer)
    response = call(build_app(SlowEngine(), NAME), "POST", "/v1/chat/completions", json=chat())
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "he llo"


# The application over a scripted engine ---------------------------------------------------------------
def test_health_models_api_key_body_limit_and_shutdown():
    engine = ScriptedEngine()
    app = build_app(engine, NAME, api_key="secret", max_body_bytes=200)
    health = {"status": "ok", "device_memory_allocated": 123, "running": 1, "waiting": 2, "graphs_unloaded": 3}
    assert call(app, "GET", "/health").json() == health  # (no key wanted)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}, {"Authorization": "secret x"}):
        response = call(app, "GET", "/v1/models", headers=headers)
        assert (response.status_code, response.json()) == (401, error_body(
            "missing or wrong API key: send the header `Authorization: Bearer <key>`", "invalid_request_error"))
    key = {"Authorization": "Bearer secret"}
    models = call(app, "GET", "/v1/models", headers=key).json()
    model, = models.pop("data")
    assert models == {"object": "list"} and abs(model["created"] - time.time()) < 60
    assert (model["id"], model["object"], model["owned_by"]) == (NAME, "model", "optimum-neuron-torch")
    assert call(build_app(ScriptedEngine(), NAME), "GET", "/v1/models").status_code == 200  # (no key at all)
    spaced = build_app(ScriptedEngine(), NAME, api_key="two words")  # (everything after "Bearer " is the key)
    assert call(spaced, "GET", "/v1/models", headers={"Authorization": "Bearer two words"}).status_code == 200
    for path in ("/docs", "/redoc", "/openapi.json"):  # no API description served, with or without a key
        assert call(build_app(ScriptedEngine(), NAME), "GET", path).status_code == 404
    for state, status in [(dict(ready=False), "loading"), (dict(alive=False), "stopped"),
                          (dict(alive=False, failure=RuntimeError()), "failed")]:
        response = call(build_app(ScriptedEngine(**state), NAME), "GET", "/health")
        assert (response.status_code, response.json()) == (503, {"status": status})
    assert call(app, "GET", "/v1/completions").headers["allow"] == "POST"  # (a 405 keeps its header)
    body = json.dumps({"model": NAME, "prompt": [1, 2], "max_tokens": 3}).encode()

    async def pieces(data: bytes):  # (no Content-Length: counted while read)
        for start in range(0, len(data), 50):
            yield data[start:start + 50]

    for content, message in [(body.ljust(201), "the request body has 201 bytes, above this server's 200 bytes"),
                             (pieces(body.ljust(201)), "the request body is above this server's 200 bytes")]:
        response = call(app, "POST", "/v1/completions", content=content, headers=key)
        assert (response.status_code, response.json()) == (413, error_body(message, "invalid_request_error"))
    for content in (body.ljust(200), pieces(body.ljust(200))):  # (the limit itself is taken)
        assert call(app, "POST", "/v1/completions", content=content, headers=key).status_code == 200
    with TestClient(app):  # (runs the application's startup and shutdown)
        assert engine.ready.is_set()
    assert not engine.ready.is_set()  # (the shutdown stopped the engine)


def test_bad_requests_and_busy_failed_or_stopped_engines_get_openai_error_bodies():
    def answer(data, engine=None, path="/v1/completions") -> httpx.Response:
        content = data if isinstance(data, bytes) else json.dumps(data).encode()
        return call(build_app(engine or ScriptedEngine(), NAME), "POST", path, content=content)

    for path, data, param, message in [
        ("/v1/chat/completions", b'{"model": ', None, "the request body is not valid JSON"),
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "the cat " * 40}]), "messages", "the "),
        ("/v1/completions", {"model": NAME, "prompt": []}, "prompt", "the prompt has no tokens"),
        ("/v1/completions", {"model": NAME, "prompt": [[1], [2, VOCAB]]}, "prompt.1", "token ids must be in [0, 128)"),
        ("/v1/completions", {"model": NAME, "prompt": [[1], []]}, "prompt.1", "the prompt has no tokens"),
        ("/v1/chat/completions", chat(n=3), "n", "n is 3, above the 2 choices this server computes at once"),
        ("/v1/completions", {"model": NAME, "prompt": [1, VOCAB]}, "prompt", "token ids must be in [0, 128), the"),
        ("/v1/completions", {"model": NAME, "prompt": [-1]}, "prompt", "token ids must be in [0, 128), the"),
        ("/v1/completions", {"model": NAME, "prompt": [1, 2], "max_tokens": 63}, "max_tokens", "max_tokens is 63"),
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": "data:image/png;"}}]}]),
         "messages.0.content.1", "messages.0.content.1: this model reads no images"),
    ]:
        response = answer(data, path=path)
        error = response.json()["error"]
        assert (response.status_code, error["type"], error["param"]) == (400, "invalid_request_error", param)
        assert error["message"].startswith(message), error
    no_template = answer(chat(), ScriptedEngine(tokenizer=tiny_tokenizer("llama")), "/v1/chat/completions").json()
    assert no_template == error_body("this model's tokenizer has no chat template: use /v1/completions",
                                     "invalid_request_error", "messages")
    full = answer({"model": NAME, "prompt": [1, 2]}, ScriptedEngine(busy=ServerBusyError("full", retry_after=1)))
    assert (full.status_code, full.headers["retry-after"], full.json()) == (
        429, "1", error_body("full", "rate_limit_exceeded"))
    stopped = answer({"model": NAME, "prompt": [1, 2]}, ScriptedEngine(busy=ServerBusyError("stopping")))
    assert (stopped.status_code, stopped.json(), "retry-after" in stopped.headers) == (
        503, error_body("stopping", "service_unavailable"), False)
    starting = answer({"model": NAME, "prompt": [1, 2]}, ScriptedEngine(busy=ServerBusyError("up", starting=True)))
    assert (starting.status_code, starting.headers["retry-after"], starting.json()) == (
        503, str(serving.STARTING_RETRY_SECONDS), error_body("up", "service_unavailable"))
    # A batch refused part-way (the queue filled after its first prompt): nothing of it stays queued.
    half = ScriptedEngine(events=[], busy=ServerBusyError("full", retry_after=1))
    half.busy_after = 1
    assert answer({"model": NAME, "prompt": [[1], [2]]}, half).status_code == 429
    assert len(half.jobs) == 1 and len(half.cancelled) == 2 and half.cancelled[0] is half.jobs[0][0]
    for path, data in [("/v1/chat/completions", chat(model="other")),
                       ("/v1/completions", {"model": "a/b", "prompt": [1]})]:
        response = answer(data, path=path)
        assert (response.status_code, response.json()) == (404, error_body(
            f"model {data['model']!r} is not served here; this server serves 'tiny-llama' (GET /v1/models)",
            "invalid_request_error", "model", "model_not_found"))
    failing = [Event("a", 1), Event("", 1, "error", "boom")]
    failed = answer(chat(), ScriptedEngine(events=failing), "/v1/chat/completions")
    message = "internal error: the serving engine failed during this request: boom"
    assert (failed.status_code, failed.json()) == (500, error_body(message, "server_error"))
    for path, data, kept in [("/v1/completions", {"model": NAME, "prompt": [1]}, 1),
                             ("/v1/chat/completions", chat(), 2)]:  # (a stream cut short ends with an error event)
        app = build_app(ScriptedEngine(events=failing), NAME)
        chunks = sse(call(app, "POST", path, json={**data, "stream": True}))
        assert len(chunks) == kept + 1 and chunks[-1] == error_body(message, "server_error")


def test_answers_whole_and_streamed_over_a_scripted_engine():
    engine = ScriptedEngine()
    app = build_app(engine, NAME)
    usage = {"prompt_tokens": len(CHAT_IDS), "completion_tokens": 3, "total_tokens": len(CHAT_IDS) + 3}
    data = call(app, "POST", "/v1/chat/completions", json=chat(max_tokens=4, stop="x", temperature=0.5, seed=1)).json()
    assert re.fullmatch(CHAT_ID, data.pop("id")) and abs(data.pop("created") - time.time()) < 60
    assert data == {"object": "chat.completion", "model": NAME, "usage": usage, "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "he llo"}}]}
    (job, field), = engine.jobs
    assert (job.prompt, job.max_tokens, job.stop, field) == (CHAT_IDS, 4, ["x"], "messages")
    assert job.sampling == SamplingSettings(temperature=0.5, seed=1) and engine.cancelled == [job]
    data = call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": [0, VOCAB - 1]}).json()
    assert re.fullmatch(COMPLETION_ID, data.pop("id")) and abs(data.pop("created") - time.time()) < 60
    assert data == {"object": "text_completion", "model": NAME, "choices": [
        {"index": 0, "text": "he llo", "finish_reason": "stop"}], "usage": {
        "prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
    assert [(job.prompt, job.max_tokens, field) for job, field in engine.jobs[-1:]] == [([0, VOCAB - 1], 16, "prompt")]
    for prompt in ("the cat", ["the cat"]):
        jobs = len(engine.jobs)
        assert call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": prompt}).status_code == 200
        assert len(engine.jobs) == jobs + 1 and engine.jobs[-1][0].prompt == TOKENIZER("the cat").input_ids
    chat_choices = [{"delta": delta, "index": 0, "finish_reason": finish} for delta, finish in [
        ({"content": "", "role": "assistant"}, None), ({"content": "he"}, None), ({"content": " llo"}, None),
        ({}, "stop")]]
    text_choices = [{"finish_reason": finish, "index": 0, "logprobs": None, "text": text}
                    for text, finish in [("he", None), (" llo", "stop")]]
    for path, data, pattern, kind, choices, prompt in [
        ("/v1/chat/completions", chat(), CHAT_ID, "chat.completion.chunk", chat_choices, len(CHAT_IDS)),
        ("/v1/completions", {"model": NAME, "prompt": [5, 6]}, COMPLETION_ID, "text_completion", text_choices, 2),
    ]:
        for include_usage in (True, False):
            chunks = sse(call(app, "POST", path, json={**data, "stream": True,
                                                       "stream_options": {"include_usage": include_usage}}))
            head = {"id": chunks[0]["id"], "created": chunks[0]["created"], "model": NAME, "object": kind}
            assert re.fullmatch(pattern, head["id"]) and abs(head["created"] - time.time()) < 60
            usage = {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3}
            assert chunks == [{**head, "choices": [choice]} for choice in choices] + [
                {**head, "choices": [], "usage": usage}] * include_usage
        chunks = sse(call(app, "POST", path, json={**data, "stream": True, "stream_options": {
            "continuous_usage_stats": True}}))  # (vLLM's: the usage so far in every chunk, as guidellm asks)
        assert [chunk["choices"] for chunk in chunks] == [[choice] for choice in choices]
        assert [chunk["usage"] for chunk in chunks] == [
            {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}
            for tokens in ([0, 1, 3, 3] if len(choices) == 4 else [1, 3])]


def test_choices_of_n_and_batched_prompts_whole_and_streamed_and_the_model_route(caplog):
    """`n` choices per prompt and a batch of prompts are one engine request each: choice i * n + j is the jth
    of prompt i, with seed + j; the usage counts each prompt once and every choice's tokens. Fields the
    OpenAI API does not define are ignored with a warning; `ignore_eos` generates up to max_tokens."""
    engine = ScriptedEngine()
    app = build_app(engine, NAME)
    with caplog.at_level("WARNING", logger="optimum_neuron_torch.serving.protocol"):
        body = {"model": NAME, "prompt": [[1, 2], [3]], "n": 2, "seed": 2**63 - 1, "temperature": 0.5,
                "ignore_eos": True, "vendor_x": 1}
        data = call(app, "POST", "/v1/completions", json=body).json()
    assert "ignored the fields the OpenAI API does not define: vendor_x" in caplog.text
    assert [(choice["index"], choice["text"]) for choice in data["choices"]] == [(i, "he llo") for i in range(4)]
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}
    jobs = [job for job, _ in engine.jobs]
    assert [(job.prompt, job.sampling.seed, job.eos_token_ids) for job in jobs] == [
        ([1, 2], 2**63 - 1, set()), ([1, 2], -(2**63), set()), ([3], 2**63 - 1, set()), ([3], -(2**63), set())]
    assert [field for _, field in engine.jobs] == ["prompt.0", "prompt.0", "prompt.1", "prompt.1"]
    assert engine.cancelled == jobs and len({id(job) for job in jobs}) == 4
    texts = call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": ["the cat", "a"]}).json()["choices"]
    assert [job.prompt for job, _ in engine.jobs[-2:]] == [TOKENIZER("the cat").input_ids, TOKENIZER("a").input_ids]
    assert [choice["index"] for choice in texts] == [0, 1] and engine.jobs[-1][0].eos_token_ids is None
    answer = call(app, "POST", "/v1/chat/completions", json=chat(n=2)).json()
    assert [(choice["index"], choice["message"]["content"]) for choice in answer["choices"]] == [
        (0, "he llo"), (1, "he llo")]
    assert answer["usage"]["completion_tokens"] == 6
    assert [job.sampling.seed for job, _ in engine.jobs[-2:]] == [None, None]
    chunks = sse(call(app, "POST", "/v1/chat/completions",
                      json=chat(n=2, stream=True, stream_options={"include_usage": True})))
    deltas = [(choice["index"], choice["delta"], choice["finish_reason"])
              for chunk in chunks for choice in chunk["choices"]]
    role = {"role": "assistant", "content": ""}
    assert deltas == [(0, role, None), (1, role, None)] + [
        (index, delta, finish) for index in (0, 1)
        for delta, finish in [({"content": "he"}, None), ({"content": " llo"}, None), ({}, "stop")]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert [chunk["usage"] for chunk in chunks if "usage" in chunk] == [chunks[-1]["usage"]]
    chunks = sse(call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": [[1], [2]], "stream": True}))
    assert [(choice["index"], choice["text"]) for chunk in chunks for choice in chunk["choices"]] == [
        (0, "he"), (0, " llo"), (1, "he"), (1, " llo")]
    model = call(app, "GET", f"/v1/models/{NAME}").json()
    assert (model["id"], model["object"]) == (NAME, "model")
    missing = call(app, "GET", "/v1/models/org/other")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")
    assert "'org/other'" in missing.json()["error"]["message"]


def test_logprobs_of_the_events_in_the_openai_shapes_whole_and_streamed():
    """The engine's log-probabilities of each token taken (and of the most likely ones) reach the client in the
    chat API's shape (`logprobs.content`: token, bytes, logprob, top_logprobs) and the completions API's columns
    (tokens, token_logprobs, top_logprobs, text_offset); the request carries how many were asked."""
    first, second = TokenLogprob(5, -0.25, ((5, -0.25), (6, -1.5))), TokenLogprob(7, -2.0, ((8, -0.5), (7, -2.0)))
    events = [Event("he", 1, logprobs=[first]), Event(" llo", 2, "stop", logprobs=[second])]
    engine = ScriptedEngine(events=events)
    app = build_app(engine, NAME)
    text = {token: TOKENIZER.decode([token]) for token in (5, 6, 7, 8)}

    def entry(token: int, logprob: float) -> dict:
        return {"token": text[token], "bytes": list(text[token].encode()), "logprob": logprob}

    content = [{**entry(item.token, item.logprob), "top_logprobs": [entry(*pair) for pair in item.top]}
               for item in (first, second)]
    choice = call(app, "POST", "/v1/chat/completions", json=chat(logprobs=True, top_logprobs=2)).json()["choices"][0]
    assert choice["logprobs"] == {"content": content} and engine.jobs[-1][0].logprobs == 2
    chunks = sse(call(app, "POST", "/v1/chat/completions", json=chat(logprobs=True, stream=True)))
    assert [chunk["choices"][0].get("logprobs") for chunk in chunks] == [
        None, {"content": content[:1]}, {"content": content[1:]}, None]
    assert engine.jobs[-1][0].logprobs == 0
    columns = {"tokens": [text[5], text[7]], "token_logprobs": [-0.25, -2.0], "text_offset": [0, len(text[5])],
               "top_logprobs": [{text[5]: -0.25, text[6]: -1.5}, {text[8]: -0.5, text[7]: -2.0}]}
    whole = call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": [1], "logprobs": 2}).json()
    assert whole["choices"][0]["logprobs"] == columns
    chunks = sse(call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": [1], "logprobs": 2,
                                                            "stream": True}))
    assert [chunk["choices"][0]["logprobs"] for chunk in chunks] == [
        {name: values[:1] for name, values in columns.items()},
        {**{name: values[1:] for name, values in columns.items()}, "text_offset": [len(text[5])]}]
    plain = call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": [1]}).json()["choices"][0]
    assert plain.get("logprobs") is None and engine.jobs[-1][0].logprobs is None


def test_echo_starts_each_completion_with_its_prompt_and_its_scores_whole_and_streamed():
    """`echo` (completions): each choice's text starts with its prompt's (the text given, or its token ids
    decoded); with `logprobs`, the engine scores the prompt, whose tokens lead the choice's columns, the first one
    with no log-probability (null, as the OpenAI API gives it). An engine without the graphs that score prompts
    refuses naming `echo`, before any request is queued; a chat request refuses `echo`."""
    prompt = [TokenLogprob(1, None), TokenLogprob(2, -1.5, ((3, -0.5), (2, -1.5)))]
    first, second = TokenLogprob(5, -0.25, ((5, -0.25), (6, -1.5))), TokenLogprob(7, -2.0, ((7, -2.0), (8, -3.0)))
    events = [Event("he", 1, logprobs=[first], prompt_logprobs=prompt), Event(" llo", 2, "stop", logprobs=[second])]
    engine = ScriptedEngine(events=events)
    app = build_app(engine, NAME)
    body = {"model": NAME, "prompt": [1, 2], "logprobs": 2, "echo": True}
    refused = call(app, "POST", "/v1/completions", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo" and not engine.jobs
    assert "--prompt-logprobs" in refused.json()["error"]["message"]
    assert call(app, "POST", "/v1/chat/completions", json=chat(echo=True)).json()["error"]["param"] == "echo"
    engine.scoring = True
    text = {token: TOKENIZER.decode([token]) for token in (1, 2, 3, 5, 6, 7, 8)}
    tokens = [text[token] for token in (1, 2, 5, 7)]
    columns = {"tokens": tokens, "token_logprobs": [None, -1.5, -0.25, -2.0],
               "text_offset": [sum(map(len, tokens[:index])) for index in range(4)],
               "top_logprobs": [None, {text[3]: -0.5, text[2]: -1.5}, {text[5]: -0.25, text[6]: -1.5},
                                {text[7]: -2.0, text[8]: -3.0}]}
    choice = call(app, "POST", "/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == TOKENIZER.decode([1, 2]) + "he llo" and choice["logprobs"] == columns
    assert engine.jobs[-1][0].prompt_logprobs == 2
    chunks = sse(call(app, "POST", "/v1/completions", json={**body, "stream": True}))
    assert [chunk["choices"][0]["text"] for chunk in chunks] == [TOKENIZER.decode([1, 2]) + "he", " llo"]
    assert [chunk["choices"][0]["logprobs"] for chunk in chunks] == [
        {name: values[:3] for name, values in columns.items()}, {name: values[3:] for name, values in columns.items()}]
    engine.events = EVENTS
    choices = call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": ["paris is", "the cat"], "n": 2,
                                                         "echo": True}).json()["choices"]
    assert [choice["text"] for choice in choices] == ["paris ishe llo"] * 2 + ["the cathe llo"] * 2
    assert engine.jobs[-1][0].prompt_logprobs is None and "logprobs" not in choices[0]


def test_a_request_scores_each_prompt_token_once_whatever_its_pieces():
    """A prompt prefilled in pieces (the last one moved back over positions the one before wrote, and padded past
    the prompt's end) notes each prompt token's score once, from the position before it, for its first event."""
    request = Request([10, 11, 12, 13, 14, 15, 16], 4, SamplingSettings(), [], print, prompt_logprobs=1)
    assert request.targets(0, 4, 0) == [[11, 12, 13, 14]] and request.targets(5, 4, 0) == [[16, 0, 0, 0]]
    assert Request([1, 2], 4, SamplingSettings(), [], print).targets(0, 4, 0) is None

    def scores(start: int, length: int) -> tuple[torch.Tensor, ...]:  # (position p: -p, its top token 100 + p)
        positions = torch.arange(start, start + length, dtype=torch.float32)
        return -positions, torch.stack([-positions / 2, -positions], 1), (100 + positions).long()[:, None].repeat(1, 2)

    request.score(0, scores(0, 4))  # positions 0-3 score tokens 1-4
    request.score(2, scores(2, 8))  # positions 2-9: 4-5 score tokens 5-6; 6 (the last token) and 7-9 (padding) none
    expected = [TokenLogprob(10, None)] + [TokenLogprob(11 + p, -p, ((100 + p, -p / 2),)) for p in range(6)]
    request.tokens.append(3)
    assert request.event("", None).prompt_logprobs == expected
    request.tokens.append(4)
    assert request.event("", None).prompt_logprobs is None  # (the first event only)
    with pytest.raises(InvalidRequestError, match="--prompt-logprobs") as caught:
        Request([1], 4, SamplingSettings(), [], print, prompt_logprobs=0).check(64)
    assert caught.value.param == "prompt_logprobs"
    Request([1], 4, SamplingSettings(), [], print, prompt_logprobs=0).check(64, scoring=True)


def test_a_request_notes_the_logprobs_of_the_tokens_it_takes_for_its_next_event():
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0])
    expected = logits.log_softmax(-1)
    request = Request([1], 4, SamplingSettings(), [], lambda event: None, logprobs=2)
    request.tokens.append(request.chosen(2, logits))
    event = request.event("x", None)
    assert event.logprobs == [TokenLogprob(2, pytest.approx(float(expected[2])), (
        (1, pytest.approx(float(expected[1]))), (2, pytest.approx(float(expected[2])))))]
    assert (event.text, event.completion_tokens) == ("x", 1) and request.event("", "stop").logprobs == []
    assert Request([1], 4, SamplingSettings(), [], print).chosen(3, logits) == 3  # (none asked: the device's token)
    none = Request([1], 4, SamplingSettings(), [], print, logprobs=0)
    none.chosen(3, logits)
    assert none.event("", None).logprobs == [TokenLogprob(3, pytest.approx(float(expected[3])))]


def test_metrics_count_the_requests_tokens_and_latencies_and_read_the_engine_when_scraped():
    """`GET /metrics` (Prometheus' text format, vLLM's names under the library's prefix): requests by finish
    reason, prompt tokens (once per prompt, whatever `n`; none for a refused request), generated tokens, one
    first-token and end-to-end latency per choice, an inter-token latency per later token; and, read when
    scraped, the engine's running and waiting requests, KV-cache slots in use, graphs not loaded, memory."""
    from prometheus_client.parser import text_string_to_metric_families

    engine = ScriptedEngine()
    app = build_app(engine, NAME, api_key="k")
    key = {"Authorization": "Bearer k"}

    def scraped() -> dict:
        response = call(app, "GET", "/metrics", headers=key)
        assert response.headers["content-type"].startswith("text/plain")
        return {(sample.name.removeprefix("optimum_neuron_torch:"), tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(response.text) for sample in family.samples}

    assert call(app, "GET", "/metrics").status_code == 401  # (the key, as every route but /health)
    empty = scraped()
    assert empty[("num_requests_running", ())] == 1 and empty[("num_requests_waiting", ())] == 2
    assert (empty[("kv_cache_usage_perc", ())], empty[("graphs_unloaded", ())]) == (0.5, 3)
    assert empty[("device_memory_bytes", ())] == 123 and empty[("generation_tokens_total", ())] == 0
    assert ("graphs_compiled", ()) in empty and ("graphs_loaded", ()) in empty
    assert empty[("prefix_cache_queries", ())] == empty[("prefix_cache_hits", ())] == 0  # (no prefix cache)
    call(app, "POST", "/v1/chat/completions", json=chat(n=2), headers=key)
    call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": [1, 2, 3]}, headers=key)
    call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": [1], "max_tokens": 99}, headers=key)  # (400)
    found = scraped()
    assert found[("request_success_total", (("finished_reason", "stop"),))] == 3
    assert found[("prompt_tokens_total", ())] == len(CHAT_IDS) + 3
    assert found[("generation_tokens_total", ())] == 9
    assert found[("time_to_first_token_seconds_count", ())] == 3
    assert found[("e2e_request_latency_seconds_count", ())] == 3
    assert found[("inter_token_latency_seconds_count", ())] == 6  # (tokens 2 and 3 of each choice)


@pytest.mark.parametrize("arguments, host, port, drain, key", [({}, "127.0.0.1", 8000, 120, None), (
    dict(host="::", port=9, api_key="k", drain_seconds=3), "::", 9, 3, "k")])
def test_run_server_serves_from_a_thread_while_the_engine_runs_on_this_one(monkeypatch, arguments, host, port,
                                                                          drain, key):
    servers, seen, signals = [], [], (signal.SIGINT, signal.SIGTERM)

    def serve(server) -> None:  # (uvicorn's loop, without a socket: until told to stop)
        servers.append((server, threading.current_thread().name))
        deadline = time.monotonic() + 10
        while not server.should_exit and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(server.should_exit)

    monkeypatch.setattr(uvicorn.Server, "run", serve)
    before, engine = [signal.getsignal(sig) for sig in signals], ScriptedEngine()
    engine.run = lambda show_progress: seen.append(
        (show_progress, [signal.getsignal(sig) for sig in signals] == [servers[0][0].handle_exit] * 2))
    run_server(engine, NAME, **arguments, show_progress=not key)
    (server, thread), = servers
    assert (server.config.host, server.config.port, server.config.timeout_graceful_shutdown) == (host, port, drain)
    assert server.config.log_level == "info" and thread == "neuron-serving-http" and seen == [(not key, True), True]
    assert [signal.getsignal(sig) for sig in signals] == before
    assert call(server.config.app, "GET", "/v1/models").status_code == (401 if key else 200)
    assert call(server.config.app, "GET", "/health").json()["status"] == "ok"  # (this engine's health)
    engine.failure = ValueError("no memory")
    with pytest.raises(RuntimeError, match="^the serving engine failed$") as caught:
        run_server(engine, NAME)
    assert caught.value.__cause__ is engine.failure
    assert seen[2][0] is True  # a progress bar by default


# The application over a compiled engine: Transformers' tokens ------------------------------------------
@pytest.fixture(scope="module")
def cpu_model(tmp_path_factory):
    """A tiny Llama (random weights, no end-of-sequence token within reach), saved in its `folder`."""
    model = noisy_llama()
    model.folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(model.folder)
    return model


@pytest.fixture(scope="module")
def app(cpu_model):
    """The application over an engine of 2 slots, 64 positions and one prompt bucket, which scores prompts
    (8 graphs: 2 score the prompt)."""
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(cpu_model.folder)
    engine = GenerationEngine(model, Buckets.for_slots(model.config, 2, 64, (16,)), TOKENIZER, scoring=True)
    engine.start(show_progress=False)
    engine.wait_ready(timeout=600)
    yield build_app(engine, NAME)  # (the ASGI transport runs no lifespan: the fixture stops the engine)
    engine.stop(60)
    assert not engine.alive


def test_answers_are_transformers_greedy_tokens_up_to_a_stop_string_and_seeds_reproduce(app, cpu_model):
    _, text = greedy_answer(cpu_model, TOKENIZER, CHAT_IDS, 10)
    usage = {"prompt_tokens": len(CHAT_IDS), "completion_tokens": 10, "total_tokens": len(CHAT_IDS) + 10}
    parts = [{"type": "text", "text": "what is the capital "}, {"type": "text", "text": "of france?"}]
    # (no temperature: the model's generation config does not sample; max_completion_tokens wins)
    answer = call(app, "POST", "/v1/chat/completions", json=chat(
        messages=[{"role": "user", "content": parts}], max_tokens=3, max_completion_tokens=10)).json()
    assert answer["choices"] == [{"index": 0, "finish_reason": "length",
                                  "message": {"role": "assistant", "content": text}}] and answer["usage"] == usage
    chunks = sse(call(app, "POST", "/v1/chat/completions", json=chat(max_tokens=10, stream=True,
                                                                     stream_options={"include_usage": True})))
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks[:-1]) == text
    assert len(chunks) > 5 and chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"] == usage
    question, prompt = "paris is the capital of", TOKENIZER("paris is the capital of").input_ids
    tokens, text = greedy_answer(cpu_model, TOKENIZER, prompt, 20)

    def complete(**fields) -> dict:
        return call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": question, **fields}).json()

    answer = complete(max_tokens=20)
    assert (answer["choices"][0]["text"], answer["usage"]["completion_tokens"]) == (text, 20)
    stop = TOKENIZER.decode(tokens[5:7], skip_special_tokens=True).strip()  # (from the middle of the answer)
    answer = complete(max_tokens=20, temperature=0, stop=[stop, "never met"])
    assert stop and (answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]) == (
        text[:text.index(stop)], "stop")
    assert answer["usage"]["completion_tokens"] < 20
    chunks = sse(call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": prompt, "stream": True}))
    streamed = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert streamed == greedy_answer(cpu_model, TOKENIZER, prompt, 16)[1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    samples = [complete(max_tokens=12, temperature=1.0, seed=seed)["choices"][0]["text"] for seed in (7, 7, 8)]
    assert samples[0] == samples[1] != samples[2]  # (the same seed, the same text; another, another)


def test_echo_with_logprobs_scores_the_prompt_as_transformers_on_the_cpu(app, cpu_model):
    """`echo` with `logprobs` (what lm-eval's loglikelihood tasks send): each prompt token's log-probability given
    those before it, and the most likely tokens', as Transformers computes them on the CPU, for a prompt of one
    piece and one prefilled in three (of 16 positions, the last padded), then the answer's token."""
    for length in (9, 40):
        prompt = [(7 * index + 3) % VOCAB for index in range(length)]
        with torch.no_grad():
            logprobs = cpu_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        tokens, text = greedy_answer(cpu_model, TOKENIZER, prompt, 1)
        choice = call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 1,
                                                             "logprobs": 2, "echo": True, "temperature": 0}
                      ).json()["choices"][0]
        columns, top = choice["logprobs"], logprobs.topk(2)
        assert choice["text"] == TOKENIZER.decode(prompt) + text
        assert columns["tokens"] == [TOKENIZER.decode([token]) for token in prompt + tokens]
        assert columns["token_logprobs"][0] is None and columns["top_logprobs"][0] is None
        assert columns["token_logprobs"][1:] == pytest.approx(
            logprobs.gather(1, torch.tensor(prompt[1:] + tokens)[:, None])[:, 0].tolist(), abs=1e-5)
        assert [value for row in columns["top_logprobs"][1:] for value in sorted(row.values(), reverse=True)
                ] == pytest.approx(top.values.flatten().tolist(), abs=1e-5)
        assert [set(row) for row in columns["top_logprobs"][1:]] == [
            {TOKENIZER.decode([token]) for token in row} for row in top.indices.tolist()]


def test_logit_bias_is_transformers_sequence_bias_of_single_tokens(app, cpu_model):
    """`logit_bias` (token id: bias) adds to the logits before the penalties, as Transformers' `sequence_bias` of
    one-token sequences does: greedy tokens equal Transformers' on the CPU; a key that is no token id, or a bias
    outside [-100, 100], gets 400 naming it."""
    prompt = TOKENIZER("paris is the capital of").input_ids
    first, _ = greedy_answer(cpu_model, TOKENIZER, prompt, 8)
    bias = {first[0]: -100.0, first[2]: 2.5, 7: 1.5}
    with torch.no_grad():
        output = cpu_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, repetition_penalty=1.2,
                                    sequence_bias={(token,): value for token, value in bias.items()})
    expected = output[0, len(prompt):].tolist()
    assert expected[0] != first[0]
    body = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "repetition_penalty": 1.2}
    answer = call(app, "POST", "/v1/completions", json={**body, "logit_bias": {
        str(token): value for token, value in bias.items()}}).json()["choices"][0]
    assert answer["text"] == TOKENIZER.decode(expected, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    for logit_bias, param in [({"x1": 1}, "logit_bias.x1"), ({str(VOCAB): 1}, f"logit_bias.{VOCAB}"),
                              ({"5": 101}, "logit_bias.5"), ({"5": "high"}, "logit_bias.5")]:
        response = call(app, "POST", "/v1/completions", json={**body, "logit_bias": logit_bias})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.slow  # (the fast tier's budget)
def test_a_restarted_server_engine_is_ready_before_loading_the_graphs_it_finds_compiled(cpu_model, tmp_path,
                                                                                         monkeypatch):
    """An engine over graphs an earlier one left whole in the compile cache (each graph's function and
    every program it ran) is ready without tracing, compiling or loading any; a request then loads
    the graphs it runs and gets Transformers' greedy tokens; the idle engine loads the others. A
    graph one of whose programs is gone is compiled before the engine is ready."""
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(tmp_path))

    models = []  # (an engine holds its model by a weak reference)

    def new_engine() -> GenerationEngine:  # (as a new process's: a new model, nothing traced or counted)
        torch._dynamo.reset()
        reset_cache_stats()
        models.append(ont.NeuronAutoModelForCausalLM.from_pretrained(cpu_model.folder))
        return GenerationEngine(models[-1], Buckets.for_slots(models[-1].config, 2, 64, (16,)), TOKENIZER)

    first = new_engine()
    first.warm_up(show_progress=False)
    graphs = len(engine_plan(first.buckets))
    assert (cache_stats().traced, first.graphs_unloaded) == (graphs, 0)  # (loading them all is the default)
    engine = new_engine()
    engine.warm_up(show_progress=False, load=False)
    stats = cache_stats()
    assert (stats.traced, stats.restored, stats.misses, stats.hits, engine.graphs_unloaded) == (0, 0, 0, 0, graphs)
    assert engine.cache_keys == first.cache_keys  # (what `save` ships with the model: every graph's entries)
    prompt = TOKENIZER("paris is the capital of").input_ids
    done = []
    engine.complete([Request(prompt, 6, SamplingSettings(), [], done.append)])
    assert [event.completion_tokens for event in done] == list(range(1, 7))
    assert "".join(event.text for event in done) == greedy_answer(cpu_model, TOKENIZER, prompt, 6)[1]
    stats = cache_stats()
    assert (stats.traced, stats.restored, stats.misses) == (0, 2, 0)  # (its prefill and greedy decode graphs)
    engine.start(show_progress=False)  # (the server's thread: ready at once, then it loads the rest while idle)
    engine.wait_ready(timeout=60)
    deadline = time.monotonic() + 120
    while engine.graphs_unloaded and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.stop(60)
    stats = cache_stats()
    assert (stats.traced, stats.restored, stats.misses, engine.graphs_unloaded) == (0, graphs, 0, 0)

    cache = CompileCache(tmp_path)  # one program gone: the graph that ran it is compiled before ready
    notes = {path: set(json.loads(path.read_text())) for path in (tmp_path / SLOTS_DIR).glob("*.programs.json")}
    assert len(notes) == graphs and len(set.union(*notes.values())) < sum(map(len, notes.values()))
    # (a program only one graph runs: one that several run is back in the cache once the first of them compiled
    # it, and the others are then left to load later, as they should)
    runs = collections.Counter(key for programs in notes.values() for key in programs)
    program = min(key for key, count in runs.items() if count == 1)
    shutil.rmtree(cache.path(program))
    engine = new_engine()
    engine.warm_up(show_progress=False, load=False)
    stats = cache_stats()
    assert (engine.graphs_unloaded, stats.restored, stats.misses, stats.traced) == (graphs - 1, 1, 1, 0)
    assert cache.get(program) is not None
