"""The OpenAI-compatible server (`optimum-cli neuron-torch serve`): the official `openai` client
against a server on localhost, its answers compared with Transformers' generate() on the CPU."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import peft
import pytest
import torch
import transformers
import uvicorn

import optimum_neuron_torch as ont
from optimum_neuron_torch.compiler import cache_stats
from optimum_neuron_torch.generation.buckets import Buckets
from optimum_neuron_torch.generation.engine import GenerationEngine
from optimum_neuron_torch.generation.requests import Event, SamplingSettings
from optimum_neuron_torch.generation.requests import Request as EngineRequest
from optimum_neuron_torch.generation.text import TextStream
from optimum_neuron_torch.serving.app import build_app
from testing_utils import free_port, launcher_environment, wait_loaded
from tiny_models import TENSOR_PARALLEL_MODELS, chat_tokenizer, greedy_answer, noisy_llama

NAME = "tiny-llama"
MAX_LENGTH = 128  # one context bucket; batch buckets 1, 2, 4, 8
PROMPT_BUCKETS = (16, 48)  # a longer prompt is prefilled in chunks of 48, the last one moved back
SLOTS = 8
QUESTIONS = ["what is the capital of france?", "the cat sat on the mat.", "paris is a city", "what is it?",
             "the capital of the city is paris and the cat is on the mat, what is the capital of france?",
             "is the cat in paris?", "the mat", "what city is the capital?"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny Llama (random weights, no end-of-sequence token within reach) with a chat template."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    noisy_llama(max_position_embeddings=MAX_LENGTH).save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def cpu_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def tokenizer(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def server(folder, tokenizer):
    """The server on a free port of localhost, in this process (on a thread), so that tests can
    look at its engine: (engine, base URL)."""
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder)
    engine = GenerationEngine(model, Buckets.for_slots(model.config, SLOTS, MAX_LENGTH, PROMPT_BUCKETS), tokenizer,
                              scoring=True)
    port = free_port()
    uvicorn_server = uvicorn.Server(uvicorn.Config(build_app(engine, NAME), host="127.0.0.1", port=port,
                                                   log_level="warning"))
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    engine.start()
    wait_loaded(engine, timeout=600)  # (the memory tests below see no graph load under them)
    assert engine.device.step.whole_graph_reason is None  # (its steps compiled a layer at a time)
    yield engine, f"http://127.0.0.1:{port}"
    uvicorn_server.should_exit = True
    thread.join(60)
    assert not engine.alive


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_ids(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


@pytest.mark.slow  # (the module's in-process server; the fast tier serves through the command below)
def test_chat_and_completions_equal_transformers_streamed_or_not(client, cpu_model, tokenizer):
    question = QUESTIONS[0]
    prompt = chat_ids(tokenizer, question)
    _, text = greedy_answer(cpu_model, tokenizer, prompt, 12)
    messages = [{"role": "user", "content": question}]
    answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert answer.choices[0].message.content == text
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (
        len(prompt), 12, len(prompt) + 12)
    assert answer.object == "chat.completion" and answer.model == NAME

    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == text
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len([chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]) > 1  # (streamed)

    plain = tokenizer(QUESTIONS[1]).input_ids
    _, text = greedy_answer(cpu_model, tokenizer, plain, 10)
    completion = client.completions.create(model=NAME, prompt=QUESTIONS[1], max_tokens=10, temperature=0)
    assert completion.choices[0].text == text and completion.usage.prompt_tokens == len(plain)
    streamed = list(client.completions.create(model=NAME, prompt=QUESTIONS[1], max_tokens=10, temperature=0,
                                              stream=True))
    assert "".join(chunk.choices[0].text for chunk in streamed) == text
    assert streamed[-1].choices[0].finish_reason == "length"
    # Token ids as the prompt, and the API's default of 16 new tokens.
    assert client.completions.create(model=NAME, prompt=plain, temperature=0).choices[0].text == greedy_answer(
        cpu_model, tokenizer, plain, 16)[1]


@pytest.mark.slow
def test_eight_clients_at_once_get_their_own_answers_and_nothing_compiles(server, cpu_model, tokenizer):
    """8 requests in flight (prompts of both buckets, different max_tokens, streamed or not) each
    get the tokens they get alone, and the mix compiles nothing."""
    engine, url = server
    lengths = [20, 7, 33, 12, 25, 5, 40, 16]
    wanted = [greedy_answer(cpu_model, tokenizer, chat_ids(tokenizer, question), length)[1]
              for question, length in zip(QUESTIONS, lengths, strict=True)]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    graphs, misses, steps = torch._dynamo.utils.counters["stats"]["unique_graphs"], cache_stats().misses, engine.steps
    busiest = []

    async def ask(question: str, length: int, stream: bool) -> str:
        messages = [{"role": "user", "content": question}]
        if not stream:
            answer = await client.chat.completions.create(model=NAME, messages=messages, max_tokens=length,
                                                          temperature=0)
            return answer.choices[0].message.content
        text = []
        async for chunk in await client.chat.completions.create(model=NAME, messages=messages, max_tokens=length,
                                                                temperature=0, stream=True):
            busiest.append(engine.busy_slots)
            text.append(chunk.choices[0].delta.content or "")
        return "".join(text)

    async def everyone() -> list[str]:
        return await asyncio.gather(*(ask(question, length, index % 2 == 0) for index, (question, length)
                                      in enumerate(zip(QUESTIONS, lengths, strict=True))))

    assert asyncio.run(everyone()) == wanted
    assert max(busiest) >= 6  # (they were in flight together)
    assert engine.steps - steps < sum(lengths)  # (decode steps served several requests each)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert cache_stats().misses == misses


@pytest.mark.slow
def test_stop_strings_end_the_text_before_them(client, cpu_model, tokenizer):
    prompt = tokenizer(QUESTIONS[2]).input_ids
    tokens, text = greedy_answer(cpu_model, tokenizer, prompt, 20)
    # A stop string from the middle of the answer: the text ends just before it, streamed or not.
    stop = tokenizer.decode(tokens[5:7], skip_special_tokens=True).strip()
    cut = text.index(stop)
    answer = client.completions.create(model=NAME, prompt=QUESTIONS[2], max_tokens=20, temperature=0,
                                       stop=[stop, "never met"])
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (text[:cut], "stop")
    assert answer.usage.completion_tokens < 20
    chunks = list(client.completions.create(model=NAME, prompt=QUESTIONS[2], max_tokens=20, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_text_stream_holds_back_the_start_of_a_stop_string(tokenizer):
    ids = tokenizer("the cat sat on the mat", add_special_tokens=False).input_ids
    stream = TextStream(tokenizer, stop=["on the mat", "sat in"])
    released = [stream.add(token) for token in ids]
    assert "".join(released) == "the cat sat " and stream.stopped
    # While the text ends with "sat", the start of "sat in", that end is held back.
    held = [step for step in range(len(ids)) if tokenizer.decode(ids[:step + 1]).endswith("sat")]
    assert held and all("".join(released[:step + 1]) == "the cat " for step in held)
    unfinished = TextStream(tokenizer, stop=["sat in"])
    assert "".join(unfinished.add(token) for token in ids) + unfinished.finish() == "the cat sat on the mat"


@pytest.mark.slow
def test_sampling_with_a_seed_does_not_depend_on_other_requests(server, client):
    engine, _ = server
    settings = dict(model=NAME, prompt=QUESTIONS[3], max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    alone = client.completions.create(**settings).choices[0].text

    async def crowded() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)
        others = [client.completions.create(model=NAME, prompt=question, max_tokens=12, temperature=1.0)
                  for question in QUESTIONS[4:7]]
        answers = await asyncio.gather(client.completions.create(**settings), *others)
        return [answer.choices[0].text for answer in answers]

    answers = asyncio.run(crowded())
    assert answers[0] == alone
    assert client.completions.create(**{**settings, "seed": 8}).choices[0].text != alone  # (the seed matters)


@pytest.mark.slow
def test_batched_prompts_and_n_choices_are_the_answers_of_single_requests(server, client, cpu_model, tokenizer):
    """A batch of prompts (texts, or token-id lists as lm-eval sends them) answers each as alone (greedy: the
    CPU's tokens); `n` sampled choices with a seed are the single requests with seed, seed + 1, ..."""
    prompts = [tokenizer(question).input_ids for question in QUESTIONS[:3]]
    expected = [greedy_answer(cpu_model, tokenizer, prompt, 8)[1] for prompt in prompts]
    for batch in (QUESTIONS[:3], prompts):
        answer = client.completions.create(model=NAME, prompt=batch, max_tokens=8, temperature=0)
        assert [(choice.index, choice.text) for choice in answer.choices] == list(enumerate(expected))
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (sum(map(len, prompts)), 24)
    settings = dict(model=NAME, max_tokens=10, temperature=1.0, top_p=0.9)
    singles = [client.completions.create(prompt=QUESTIONS[3], seed=seed, **settings).choices[0].text
               for seed in (7, 8, 9)]
    choices = client.completions.create(prompt=[QUESTIONS[3], QUESTIONS[3]], n=3, seed=7, **settings).choices
    assert [choice.text for choice in choices] == singles * 2 and len(set(singles)) > 1
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    chat = client.chat.completions.create(model=NAME, messages=messages, n=2, max_tokens=8, temperature=0)
    expected = greedy_answer(cpu_model, tokenizer, chat_ids(tokenizer, QUESTIONS[0]), 8)[1]
    assert [choice.message.content for choice in chat.choices] == [expected, expected]


@pytest.mark.slow
def test_logprobs_are_those_of_transformers_on_the_cpu(client, cpu_model, tokenizer):
    """`logprobs` / `top_logprobs` (chat) and `logprobs` (completions): each generated token's log-probability
    under the model's raw logits and the most likely tokens', as Transformers computes them on the CPU."""
    prompt = chat_ids(tokenizer, QUESTIONS[0])
    tokens, text = greedy_answer(cpu_model, tokenizer, prompt, 6)
    with torch.no_grad():
        logits = cpu_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    expected = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    top = logits.topk(3)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                            top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert answer.choices[0].message.content == text
    assert [item.token for item in content] == [tokenizer.decode([token]) for token in tokens]
    assert [item.logprob for item in content] == pytest.approx(expected, abs=1e-4)
    assert [[tokenizer.decode([t]) for t in row] for row in top.indices.tolist()] == [
        [choice.token for choice in item.top_logprobs] for item in content]
    assert [choice.logprob for item in content for choice in item.top_logprobs] == pytest.approx(
        top.values.flatten().tolist(), abs=1e-4)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [item for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    assert [item.logprob for item in streamed] == pytest.approx(expected, abs=1e-4)
    assert all(item.top_logprobs == [] for item in streamed)
    completion = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    columns = completion.choices[0].logprobs
    assert columns.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert columns.tokens == [tokenizer.decode([token]) for token in tokens]  # (each decoded alone)
    assert columns.text_offset == [len("".join(columns.tokens[:index])) for index in range(6)]
    assert [len(row) for row in columns.top_logprobs] == [2] * 6
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.slow
def test_echo_with_logprobs_scores_a_long_prompt_as_transformers_on_the_cpu(client, cpu_model, tokenizer):
    """lm-eval's loglikelihood request (`echo`, `logprobs: 1`, `max_tokens: 1`) for a batch of a short prompt and
    one prefilled in three chunks, the last moved back over positions the one before wrote: each prompt token's
    log-probability is Transformers' on the CPU, and whether each token is the greedy one, as lm-eval reads it."""
    prompts = [tokenizer(QUESTIONS[0]).input_ids, tokenizer(" ".join(QUESTIONS * 2)).input_ids[:MAX_LENGTH - 2]]
    assert len(prompts[1]) > 2 * PROMPT_BUCKETS[-1]
    answer = client.completions.create(model=NAME, prompt=prompts, max_tokens=1, logprobs=1, echo=True, temperature=0)
    for prompt, choice in zip(prompts, answer.choices, strict=True):
        with torch.no_grad():
            logprobs = cpu_model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
        columns = choice.logprobs
        assert len(columns.tokens) == len(prompt) + 1 and columns.token_logprobs[0] is None
        assert columns.token_logprobs[1:-1] == pytest.approx(
            logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist(), abs=1e-4)
        greedy = [max(top.values()) == logprob for top, logprob in zip(columns.top_logprobs[1:-1],
                                                                       columns.token_logprobs[1:-1], strict=True)]
        assert greedy == (logprobs.argmax(-1) == torch.tensor(prompt[1:])).tolist()
        assert choice.text.startswith(tokenizer.decode(prompt))


@pytest.mark.slow
@pytest.mark.parametrize("body, param", [
    (b'{"model": "tiny-llama", "messages": [', None),
    ({"model": NAME}, "messages"),
    ({"model": NAME, "messages": "hi"}, "messages"),
    ({"model": NAME, "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, "max_tokens"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"}, "max_tokens"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}, "max_tokens"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 99}, "n"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_k": 2**40}, "top_k"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "min_p": 1.5}, "min_p"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": NAME, "messages": [{"role": "user", "content": "the cat " * 80}]}, "messages"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "seed": 2**70}, "seed"),
])
def test_bad_requests_get_400_naming_the_field(server, body, param):
    _, url = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(url + "/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


@pytest.mark.slow
def test_completion_prompts_it_cannot_take_get_400(server):
    _, url = server
    for prompt, message, param in [([1, 2, 100000], "vocabulary", "prompt"), ([], "no tokens", "prompt"),
                                   ([[1], []], "no tokens", "prompt.1"),
                                   ([[1], [2, 100000]], "vocabulary", "prompt.1")]:
        response = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": prompt})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert message in response.json()["error"]["message"]


@pytest.mark.slow
def test_clients_that_disconnect_free_their_slots(server, client, cpu_model, tokenizer):
    """20 clients drop their streams after a token or two: each slot is free again within a step,
    the cache's memory is as before, and the next answer is right."""
    engine, url = server
    memory, steps = torch.neuron.memory_allocated(), engine.steps

    def drop() -> None:
        with httpx.stream("POST", url + "/v1/completions",
                          json={"model": NAME, "prompt": QUESTIONS[0], "max_tokens": 100, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # (the client goes away mid-stream)

    threads = [threading.Thread(target=drop) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    deadline = time.monotonic() + 120
    while (engine.busy_slots or engine.waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (engine.busy_slots, engine.waiting) == (0, 0)
    # 20 requests of 100 tokens over 8 slots would take 250 steps; they left after a few each (the
    # bound leaves room for a loaded machine, whose event loop notices the disconnections late).
    assert engine.steps - steps < 125
    assert torch.neuron.memory_allocated() == memory
    prompt = tokenizer(QUESTIONS[5]).input_ids
    assert client.completions.create(model=NAME, prompt=QUESTIONS[5], max_tokens=8, temperature=0).choices[0].text \
        == greedy_answer(cpu_model, tokenizer, prompt, 8)[1]


@pytest.mark.slow
def test_a_long_prompt_is_prefilled_a_chunk_a_turn_between_the_others_decode_steps(server, cpu_model, tokenizer,
                                                                                  monkeypatch):
    """A prompt above every prompt bucket (120 tokens; buckets 16 and 48, a cache of 128) is
    prefilled in three pieces, one a turn (the budget is one chunk), the last moved back to end at
    the cache's end, while a request in a higher slot decodes between them (so the long prompt's
    slot is a thrown-away row of those decode steps): both get the CPU's tokens, and the keys the
    pieces wrote are the CPU's (the thrown-away rows wrote none over them). A second long prompt,
    cancelled after its first piece while the others decode, runs no other piece; the slots empty
    and the device memory is as before."""
    engine, _ = server
    memory = torch.neuron.memory_allocated()
    short_prompt, long_prompt = chat_ids(tokenizer, QUESTIONS[3]), (tokenizer(QUESTIONS[4]).input_ids * 20)[:120]
    first, short, long, cancelled = [], [], [], []
    pieces, run_piece = [], engine._run_piece

    written = []  # the long prompt's first-layer keys in its slot, before its last piece

    def recording(request, start, length, context):
        pieces.append((request.on_event.__self__, start, length, context, len(short)))
        if request.on_event.__self__ is long and start + length == MAX_LENGTH:
            layer = engine.cache.layers[0]  # ([slots, heads, positions, head_dim])
            keys = layer.keys.view(layer.slots, layer.num_heads, MAX_LENGTH, -1)
            written.append(keys[request._slot, :, :start].cpu().clone())
        run_piece(request, start, length, context)
        if request.on_event.__self__ is cancelled:
            engine.cancel(request)

    monkeypatch.setattr(engine, "_run_piece", recording)

    def wait_until(condition) -> None:
        deadline = time.monotonic() + 120
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert condition()

    with engine._condition:  # (both in the same turn: slots 0 and 1)
        engine.submit(EngineRequest(short_prompt, 1, SamplingSettings(), [], first.append))  # one token
        engine.submit(EngineRequest(short_prompt, 40, SamplingSettings(), [], short.append))
    wait_until(lambda: first and len(short) >= 2)
    engine.submit(EngineRequest(long_prompt, 8, SamplingSettings(), [], long.append))  # slot 0 again
    engine.submit(EngineRequest(long_prompt, 8, SamplingSettings(), [], cancelled.append))  # after it: slot 2
    wait_until(lambda: long and long[-1].finish_reason)
    long_pieces = [piece[1:] for piece in pieces if piece[0] is long]
    assert [piece[:3] for piece in long_pieces] == [(0, 48, 48), (48, 48, 128), (80, 48, 128)]
    assert long_pieces[0][3] < long_pieces[1][3] < long_pieces[2][3]  # (the short request decoded between)
    assert engine._slots[1] is not None and engine._slots[1].on_event.__self__ is short
    assert "".join(event.text for event in long) == greedy_answer(cpu_model, tokenizer, long_prompt, 8)[1]
    with torch.no_grad():  # (what the CPU writes for those positions: nothing else overwrote them)
        cpu_cache = cpu_model(torch.tensor([long_prompt[:80]]), use_cache=True).past_key_values
    torch.testing.assert_close(written[0], cpu_cache.layers[0].keys[0], rtol=1e-5, atol=1e-5)

    wait_until(lambda: short and short[-1].finish_reason)
    assert "".join(event.text for event in short) == greedy_answer(cpu_model, tokenizer, short_prompt, 40)[1]
    wait_until(lambda: (engine.busy_slots, engine.waiting) == (0, 0))
    assert [piece[1] for piece in pieces if piece[0] is cancelled] == [0] and cancelled == []
    assert torch.neuron.memory_allocated() == memory


class OpenAIPenalties(transformers.LogitsProcessor):
    """The OpenAI API's presence and frequency penalties over the tokens generated after the prompt."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_length:]
        counts = torch.zeros_like(scores).scatter_add(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.presence * (counts > 0) - self.frequency * counts


@pytest.mark.slow
def test_penalties_and_min_p_run_in_the_step_as_transformers_applies_them(client, cpu_model, tokenizer):
    """Greedy answers with Transformers' repetition penalty and the OpenAI API's presence and
    frequency penalties are Transformers' on the CPU (with the penalties as its logits processors),
    for a short prompt and for one prefilled in chunks, one request after another in the same slot
    (each starts from its own tokens); each differs from the answer without them. A min_p of 1
    keeps the most likely token only: sampling then answers as greedy decoding does."""
    short, long = tokenizer(QUESTIONS[2]).input_ids, (tokenizer(QUESTIONS[4]).input_ids * 20)[:120]
    for prompt, tokens, body, cpu in [
        (short, 24, {"repetition_penalty": 1.8}, dict(repetition_penalty=1.8)),
        (short, 24, {"presence_penalty": 1.5, "frequency_penalty": 0.7},
         dict(logits_processor=[OpenAIPenalties(len(short), 1.5, 0.7)])),
        (long, 8, {"repetition_penalty": 1.8, "frequency_penalty": 2.0},
         dict(repetition_penalty=1.8, logits_processor=[OpenAIPenalties(len(long), 0.0, 2.0)])),
    ]:
        answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=tokens, temperature=0,
                                           extra_body=body).choices[0].text
        with torch.no_grad():
            output = cpu_model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, **cpu)
        assert answer == tokenizer.decode(output[0, len(prompt):], skip_special_tokens=True,
                                          clean_up_tokenization_spaces=False), body
        assert answer != greedy_answer(cpu_model, tokenizer, prompt, tokens)[1], body
    greedy = client.completions.create(model=NAME, prompt=short, max_tokens=16, temperature=1.0, seed=3,
                                       extra_body={"min_p": 1.0}).choices[0].text
    assert greedy == greedy_answer(cpu_model, tokenizer, short, 16)[1]


@pytest.mark.slow
def test_a_request_that_fails_fails_alone_and_the_engine_serves_on(server, client, cpu_model, tokenizer, monkeypatch):
    """A request the engine cannot prepare (a seed torch's generator refuses, given to the engine
    directly), then a decode step that raises: each ends its own requests with an error naming what
    failed, the slots and device memory come back, and the next request gets the CPU's answer."""
    engine, _ = server
    memory = torch.neuron.memory_allocated()
    events: list[Event] = []
    engine.submit(EngineRequest(tokenizer(QUESTIONS[1]).input_ids, 4, SamplingSettings(temperature=1.0, seed=2**70),
                                [], events.append))
    step, failed = engine.device.step, []

    def failing_decode(*args, **kwargs):
        if engine.cache.writes.slot is None and not failed:  # (the first decode step only)
            failed.append(True)
            raise RuntimeError("a decode step that fails")
        return step(*args, **kwargs)

    monkeypatch.setattr(engine.device, "step", failing_decode)
    engine.submit(EngineRequest(tokenizer(QUESTIONS[2]).input_ids, 4, SamplingSettings(), [], events.append))
    deadline = time.monotonic() + 120
    while len([event for event in events if event.finish_reason]) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(event.finish_reason, event.completion_tokens) for event in events] == [
        ("error", 0), (None, 1), ("error", 1)], events  # (the second had its prefill's token)
    assert events[0].error.startswith("ValueError while preparing the request: Overflow")
    assert events[2].error == "RuntimeError while running a decode step: a decode step that fails"
    assert engine.alive and (engine.busy_slots, engine.waiting) == (0, 0)
    assert torch.neuron.memory_allocated() == memory
    prompt = tokenizer(QUESTIONS[5]).input_ids
    assert client.completions.create(model=NAME, prompt=QUESTIONS[5], max_tokens=8, temperature=0).choices[0].text \
        == greedy_answer(cpu_model, tokenizer, prompt, 8)[1]


@pytest.mark.slow
def test_requests_beyond_the_queue_get_429(server):
    engine, url = server
    queue_size, engine.queue_size = engine.queue_size, 2

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={
                "model": NAME, "prompt": QUESTIONS[0], "max_tokens": 100}) for _ in range(SLOTS + 6)))

    try:
        responses = asyncio.run(flood())
    finally:
        engine.queue_size = queue_size
    statuses = [response.status_code for response in responses]
    # 8 slots and 2 places in the queue: while the first are generating (100 tokens each), at most
    # 10 are taken, the others are turned away; those taken are answered.
    assert set(statuses) == {200, 429} and statuses.count(429) >= 4, statuses
    refused = next(response for response in responses if response.status_code == 429)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["type"] == "rate_limit_exceeded"
    assert all(len(response.json()["choices"][0]["text"]) > 0 for response in responses if response.status_code == 200)


@pytest.mark.slow
def test_api_key_body_limit_health_and_models(server, folder, tokenizer):
    engine, _ = server

    async def run() -> None:
        # (ASGI transport: no lifespan, so these apps leave the shared engine running)
        app = build_app(engine, NAME, api_key="secret", max_body_bytes=1000)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
            assert (await http.get("/health")).status_code == 200  # (no key needed)
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
                response = await http.get("/v1/models", headers=headers)
                assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
            key = {"Authorization": "Bearer secret"}
            models = (await http.get("/v1/models", headers=key)).json()
            assert [model["id"] for model in models["data"]] == [NAME] and models["object"] == "list"
            assert (await http.get(f"/v1/models/{NAME}", headers=key)).json()["id"] == NAME
            metrics = (await http.get("/metrics", headers=key)).text
            assert "optimum_neuron_torch:kv_cache_usage_perc " in metrics
            large = {"model": NAME, "prompt": "x" * 2000}
            response = await http.post("/v1/completions", json=large, headers=key)
            assert response.status_code == 413 and "1000 bytes" in response.json()["error"]["message"]
            response = await http.post("/v1/completions", headers=key, content=_chunks(json.dumps(large).encode()))
            assert response.status_code == 413  # (no Content-Length: counted while read)
        # An engine still compiling: /health and requests answer 503.
        starting = GenerationEngine(engine.model, Buckets.for_slots(engine.model.config, 1, MAX_LENGTH), tokenizer)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(starting, NAME)),
                                     base_url="http://test") as http:
            health = await http.get("/health")
            assert (health.status_code, health.json()["status"]) == (503, "loading")
            response = await http.post("/v1/completions", json={"model": NAME, "prompt": "hi"})
            assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
            assert response.headers["retry-after"] == "5"  # (as long as the graphs compile or load)

    asyncio.run(run())


async def _chunks(data: bytes):
    for start in range(0, len(data), 100):
        yield data[start:start + 100]


@pytest.mark.slow
def test_the_example_client_runs_as_written(server, cpu_model, tokenizer):
    _, url = server
    example = Path(__file__).parent.parent / "examples" / "serve_client.py"
    result = subprocess.run([sys.executable, str(example), "--base-url", url + "/v1", "--model", NAME],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    _, text = greedy_answer(cpu_model, tokenizer, chat_ids(tokenizer, "What is the capital of France?"), 32)
    assert f"models: ['{NAME}']" in result.stdout
    assert f"answer: {text!r}" in result.stdout
    assert "4 questions at once, answered in" in result.stdout


def start_command(folder: Path, *arguments: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`optimum-cli neuron-torch serve FOLDER ARGUMENTS` on a free port, once /health says it is ready:
    the process and its base URL."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "optimum.commands.optimum_cli", "neuron-torch", "serve",
                                str(folder), "--port", str(port), "--max-length", str(MAX_LENGTH), *arguments],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            raise AssertionError(process.stdout.read()[-4000:])
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"not ready in 600 s: {process.stdout.read()[-4000:]}")


def test_the_command_serves_on_localhost_and_drains_on_sigterm(folder, cpu_model, tokenizer):
    """`optimum-cli neuron-torch serve`: binds 127.0.0.1; on SIGTERM it takes no new request, finishes
    the one streaming, and exits 0. With `--speculative-config`, its one request at a time is speculated
    (`/metrics` counts the drafts), and the answers are still Transformers' greedy ones."""
    # (one slot and one prompt bucket: 4 graphs to compile, the 2 that score prompts, a verify graph per context)
    process, url = start_command(folder, "--batch-size", "1", "--prompt-buckets", "16", "--prompt-logprobs",
                                 "--speculative-config", '{"num_speculative_tokens": 3, "prompt_lookup_min": 1}',
                                 env={**os.environ, "OPTIMUM_NEURON_TORCH_API_KEY": "secret"})
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="secret", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        prompt = tokenizer(QUESTIONS[6]).input_ids
        with torch.no_grad():
            logprobs = cpu_model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
        scored = client.completions.create(model=str(folder), prompt=prompt, max_tokens=1, logprobs=0, echo=True)
        assert scored.choices[0].logprobs.token_logprobs[1:-1] == pytest.approx(
            logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist(), abs=1e-4)
        answer = client.completions.create(model=str(folder), prompt=QUESTIONS[5], max_tokens=40, temperature=0)
        assert answer.choices[0].text == greedy_answer(cpu_model, tokenizer, tokenizer(QUESTIONS[5]).input_ids, 40)[1]
        metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer secret"}).text
        [drafts] = [line.split()[1] for line in metrics.splitlines()
                    if line.startswith("optimum_neuron_torch:spec_decode_num_drafts ")]
        assert float(drafts) > 0
        stream = client.completions.create(model=str(folder), prompt=QUESTIONS[6], max_tokens=40, temperature=0,
                                           stream=True)
        text = [next(stream).choices[0].text]
        process.send_signal(signal.SIGTERM)
        text += [chunk.choices[0].text for chunk in stream]
        assert "".join(text) == greedy_answer(cpu_model, tokenizer, prompt, 40)[1]
        assert process.wait(60) == 0
        output = process.stdout.read()
        assert f"Uvicorn running on {url}" in output
        assert "could not be compiled once each" not in output  # (its steps compiled a layer at a time)
    finally:
        process.kill()
        process.wait()
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health")


@pytest.mark.slow
def test_the_command_serves_lora_adapters_named_as_the_model(folder, cpu_model, tokenizer, tmp_path):
    """`serve --lora-modules NAME=FOLDER`: `/v1/models` lists the adapter; a request naming it gets PEFT's greedy
    answer on the CPU, one naming the model Transformers'."""
    adapter = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder),
                                  peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, parameter in adapter.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.3)
    adapter.save_pretrained(tmp_path / "adapter")
    process, url = start_command(folder, "--batch-size", "1", "--prompt-buckets", "16",
                                 "--lora-modules", f"sql={tmp_path / 'adapter'}", "--max-lora-rank", "4")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert [model.id for model in client.models.list()] == [str(folder), "sql"]
        prompt = tokenizer(QUESTIONS[4]).input_ids
        with torch.no_grad():
            expected = adapter.eval().generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        tuned = client.completions.create(model="sql", prompt=QUESTIONS[4], max_tokens=12, temperature=0)
        assert tuned.choices[0].text == tokenizer.decode(expected[0, len(prompt):], skip_special_tokens=True,
                                                         clean_up_tokenization_spaces=False)
        base = client.completions.create(model=str(folder), prompt=QUESTIONS[4], max_tokens=12, temperature=0)
        assert base.choices[0].text == greedy_answer(cpu_model, tokenizer, prompt, 12)[1] != tuned.choices[0].text
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_a_model_split_between_two_ranks_serves_the_same_answers(tmp_path):
    """`serve --tp-size 2`: rank 0 speaks HTTP, rank 1 runs the same steps; the answers are the whole
    model's on the CPU, also for more requests than slots; SIGTERM stops both ranks, status 0."""
    folder = TENSOR_PARALLEL_MODELS["llama"].save_with_tokenizer(tmp_path / "llama")
    config = transformers.AutoConfig.from_pretrained(folder)
    config.max_position_embeddings = MAX_LENGTH
    config.save_pretrained(folder)
    cpu_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    process, url = start_command(folder, "--tp-size", "2", "--batch-size", "2", env=launcher_environment())
    try:
        async def ask() -> list[str]:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
            answers = await asyncio.gather(*(client.completions.create(
                model=str(folder), prompt=question, max_tokens=8, temperature=0) for question in QUESTIONS[:3]))
            return [answer.choices[0].text for answer in answers]

        assert asyncio.run(ask()) == [greedy_answer(cpu_model, tokenizer, tokenizer(question).input_ids, 8)[1]
                                      for question in QUESTIONS[:3]]
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 0, process.stdout.read()[-4000:]
    finally:
        process.kill()
        process.wait()
