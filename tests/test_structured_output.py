"""Answers held to a grammar (`serving.structured_output`: `response_format`) and tool calls (`serving.tool_calls`:
`tools`, `tool_choice`): the parsers, the application over a scripted engine, and one tiny compiled engine over the
default model's tokenizer whose answers are compared with Transformers' on the CPU, masked by the same grammar."""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import Literal

import pytest
import torch
import transformers

import optimum_neuron_torch as ont
from optimum_neuron_torch.errors import InvalidRequestError
from optimum_neuron_torch.generation.buckets import Buckets
from optimum_neuron_torch.generation.engine import GenerationEngine
from optimum_neuron_torch.generation.requests import Event, SamplingSettings
from optimum_neuron_torch.serving.app import build_app
from optimum_neuron_torch.serving.structured_output import Grammars
from optimum_neuron_torch.serving.tool_calls import ToolChoice, parser_of_template, tool_choice
from test_serving_app import NAME, TOKENIZER, USER, ScriptedEngine, call, sse
from tiny_models import noisy_llama


@pytest.fixture(scope="module")
def json_app(tmp_path_factory):
    """The application over an engine of 1 slot, 64 positions and one prompt bucket (4 graphs), serving a tiny
    Llama (random weights) over the default model's tokenizer (byte-level BPE, 49152 tokens: what JSON is
    written in), whose answers end at `<|im_end|>`: (application, CPU model, tokenizer)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(ont.default_model_path())
    cpu_model = noisy_llama(vocab_size=len(tokenizer))
    cpu_model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    folder = tmp_path_factory.mktemp("json-llama")
    cpu_model.save_pretrained(folder)
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder)
    engine = GenerationEngine(model, Buckets.for_slots(model.config, 1, 64, (16,)), tokenizer)
    engine.start(show_progress=False)
    engine.wait_ready(timeout=600)
    yield build_app(engine, NAME), cpu_model, tokenizer
    engine.stop(60)


def grammar_greedy(cpu_model, tokenizer, prompt: list[int], grammar: str, repetition_penalty: float,
                   max_tokens: int, presence_penalty: float = 0.0) -> list[int]:
    """Transformers' model on the CPU choosing greedily, after its repetition penalty and the OpenAI API's presence
    penalty, among the tokens llguidance's matcher of `grammar` allows at each step."""
    import llguidance.hf
    import llguidance.torch

    vocab = cpu_model.config.vocab_size
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(
        tokenizer, n_vocab=vocab, eos_token=cpu_model.generation_config.eos_token_id), grammar)
    bitmask, ids = llguidance.torch.allocate_token_bitmask(1, vocab), torch.tensor([prompt])
    penalty = transformers.RepetitionPenaltyLogitsProcessor(repetition_penalty)
    for _ in range(max_tokens):
        with torch.no_grad():
            scores = penalty(ids, cpu_model(ids).logits[:, -1])
        generated = torch.zeros(vocab).index_fill_(0, ids[0, len(prompt):], 1.0)
        scores -= presence_penalty * generated
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        llguidance.torch.apply_token_bitmask_inplace(scores, bitmask)
        token = int(scores.argmax(-1))
        assert matcher.consume_token(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        if token == cpu_model.generation_config.eos_token_id:
            break
    return ids[0, len(prompt):].tolist()


def test_a_schema_is_compiled_once_and_a_refused_one_each_time_naming_its_field(monkeypatch):
    import llguidance

    compiled, compile_schema = [], llguidance.LLMatcher.grammar_from_json_schema
    monkeypatch.setattr(llguidance.LLMatcher, "grammar_from_json_schema",
                        lambda schema, **options: (compiled.append(schema), compile_schema(schema, **options))[1])
    grammars = Grammars(TOKENIZER, len(TOKENIZER), {TOKENIZER.eos_token_id})  # (checked without the tokenizer)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    first = grammars.schema(schema, "tools.0.function.parameters", for_answers=False)
    assert grammars.schema(dict(reversed(schema.items())), "tools.1", for_answers=False) == first
    assert len(compiled) == 1
    for field in ("response_format", "tools.1.function.parameters"):
        with pytest.raises(InvalidRequestError) as caught:
            grammars.schema({"type": "integer", "minimum": "x"}, field, for_answers=False)
        assert caught.value.param == field
    assert len(compiled) == 3


def test_a_grammar_sampler_penalizes_the_prompt_and_what_it_chose_as_the_step_does():
    """The host's choice for a grammar: the logit bias, then Transformers' repetition penalty over the prompt and the
    answer, the OpenAI API's presence and frequency penalties over the answer (counted as it goes), the tokens the
    grammar refuses dropped (every token but a, b and c here, whatever their bias); the same draws from the same
    seed; top-k 1 draws the greedy one."""
    import llguidance

    tokenizer = transformers.AutoTokenizer.from_pretrained(ont.default_model_path())
    grammars, letters = Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id}), "abcd"
    grammar = llguidance.LLMatcher.grammar_from_lark("start: /[abc]+/")
    ids = [tokenizer.convert_tokens_to_ids(letter) for letter in letters]
    logits = torch.full((len(tokenizer),), -100.0)
    logits[ids] = torch.tensor([5.0, 4.6, 4.2, 9.0])  # (d: the most likely, refused by the grammar)

    def expected(prompt: str, repetition: float, presence: float, frequency: float, bias: dict | None = None) -> str:
        counts, chosen = collections.Counter(), ""
        for _ in range(6):
            scores = {}
            for letter, logit in zip("abc", [5.0, 4.6, 4.2], strict=True):
                logit += (bias or {}).get(letter, 0.0)  # (the logit bias first, then the penalties)
                if letter in prompt or counts[letter]:
                    logit = logit / repetition if logit > 0 else logit * repetition
                scores[letter] = logit - presence * (counts[letter] > 0) - frequency * counts[letter]
            best = max(scores, key=scores.get)
            chosen, counts[best] = chosen + best, counts[best] + 1
        return chosen

    def chosen(prompt: str, generator: torch.Generator | None = None, bias: dict | None = None, **settings) -> str:
        sampler = grammars.sampler(grammar, SamplingSettings(**settings), [ids[letters.index(x)] for x in prompt],
                                   {ids[letters.index(x)]: value for x, value in (bias or {}).items()})
        return "".join(letters[ids.index(sampler(logits.clone(), generator))] for _ in range(6))

    for prompt, repetition, presence, frequency in [("", 1.0, 0.0, 0.0), ("", 1.0, 1.0, 0.5), ("a", 2.0, 0.0, 0.0),
                                                    ("b", 1.5, 0.3, 0.2), ("", 1.0, 0.0, 0.3)]:
        assert chosen(prompt, repetition_penalty=repetition, presence_penalty=presence,
                      frequency_penalty=frequency) == expected(prompt, repetition, presence, frequency)
    for bias in ({"a": 4.0}, {"c": 0.5, "d": 50.0}, {"b": -1.0}):
        assert chosen("a", bias=bias, repetition_penalty=2.0, presence_penalty=0.5) == expected("a", 2.0, 0.5, 0.0,
                                                                                                bias)
    assert chosen("a", bias={"a": 4.0}, repetition_penalty=2.0)[0] == "b"  # ((5 + 4) / 2 < 4.6: penalized after)
    assert len({chosen("", torch.Generator().manual_seed(seed), temperature=3.0) for seed in range(8)}) > 1
    assert chosen("", torch.Generator().manual_seed(1), temperature=3.0) == chosen(
        "", torch.Generator().manual_seed(1), temperature=3.0)
    assert chosen("", torch.Generator(), temperature=3.0, top_k=1, presence_penalty=1.0) == expected("", 1, 1, 0)


def test_answers_held_to_a_json_schema_are_the_cpu_greedy_tokens_the_grammar_allows(json_app):
    """`response_format` `json_schema` (and `json_object`): each token is the model's greedy one after the request's
    penalty among those the schema's grammar allows next (the CPU model's, with Transformers' repetition penalty,
    masked by llguidance), the answer parses and ends (`stop`) where the grammar does; streamed the same; sampled
    with a seed, it parses and reproduces. A schema the grammar compiler refuses gets 400 naming it."""
    app, cpu_model, tokenizer = json_app
    schema = {"type": "object", "properties": {"digit": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "pet": {"enum": ["cat", "dog", "owl"]}},
              "required": ["digit", "pet"], "additionalProperties": False}
    prompt = tokenizer("My pet: {\"name\":\"PSC ', synNN\"}. As JSON:").input_ids  # (the penalty changes the name)
    grammars = Grammars(tokenizer, len(tokenizer), {cpu_model.generation_config.eos_token_id})
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}
    expected = grammar_greedy(cpu_model, tokenizer, prompt, grammars.grammar(response_format), 1.3, 40)
    assert expected[-1] == cpu_model.generation_config.eos_token_id
    body = {"model": NAME, "prompt": prompt, "max_tokens": 40, "repetition_penalty": 1.3, "temperature": 0,
            "response_format": response_format}
    choice = call(app, "POST", "/v1/completions", json=body).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (tokenizer.decode(expected[:-1]), "stop")
    answer = json.loads(choice["text"])
    assert set(answer) == {"digit", "pet"} and 0 <= answer["digit"] <= 9 and answer["pet"] in ("cat", "dog", "owl")
    chunks = sse(call(app, "POST", "/v1/completions", json={**body, "stream": True}))
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == choice["text"]
    named = {"type": "json_schema", "json_schema": {"name": "name", "schema": {
        "type": "object", "properties": {"name": {"type": "string", "minLength": 10, "maxLength": 12}},
        "required": ["name"], "additionalProperties": False}}}  # (free text: the penalty chooses among tokens)
    expected = grammar_greedy(cpu_model, tokenizer, prompt, grammars.grammar(named), 2.0, 30, 0.5)
    choice = call(app, "POST", "/v1/completions", json={**body, "max_tokens": 30, "repetition_penalty": 2.0,
                                                         "presence_penalty": 0.5, "response_format": named}
                  ).json()["choices"][0]
    assert choice["text"] == tokenizer.decode(expected[:-1]) and 10 <= len(json.loads(choice["text"])["name"]) <= 12
    anything = {"type": "json_object"}
    expected = grammar_greedy(cpu_model, tokenizer, prompt, grammars.grammar(anything), 1.3, 8)
    choice = call(app, "POST", "/v1/completions", json={**body, "max_tokens": 8, "response_format": anything}
                  ).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (tokenizer.decode(expected), "length")  # (cut: no end)
    assert choice["text"].startswith('{"') and tokenizer.eos_token_id not in expected
    sampled = [call(app, "POST", "/v1/chat/completions", json={
        "model": NAME, "messages": USER, "max_tokens": 20, "temperature": 1.0, "seed": seed,
        "response_format": response_format}).json()["choices"][0]["message"]["content"] for seed in (5, 5, 6)]
    assert sampled[0] == sampled[1] and all(json.loads(text)["pet"] in ("cat", "dog", "owl") for text in sampled)
    refused = call(app, "POST", "/v1/completions", json={**body, "response_format": {
        "type": "json_schema", "json_schema": {"name": "pet", "schema": {"type": "objectx"}}}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format.json_schema.schema"
    assert "objectx" in refused.json()["error"]["message"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_the_parsers_read_the_tool_calls_each_format_writes_and_leave_other_text_as_content():
    hermes, llama, mistral = (ToolChoice("auto", parser) for parser in ("hermes", "llama3_json", "mistral"))

    def read(choice: ToolChoice, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
        content, calls = choice.read(text)
        return content, [(call.function.name, json.loads(call.function.arguments)) for call in calls]

    paris, rome = ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})
    assert read(hermes, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                        '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}') == (
        "Let me look.", [paris, rome])  # (the last block unclosed: the answer ended in it)
    for text in ("It is sunny.", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
                 '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": "x", "arguments": "no"}</tool_call>'):
        assert read(hermes, text) == (text, [])  # (no well-formed call: the text is the answer)
    assert read(llama, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                       '{"name": "get_weather", "arguments": {"city": "Rome"}}') == (None, [paris, rome])
    assert read(llama, '{"name": "get_weather", "parameters": {"city": "Paris"}} and more') == (
        '{"name": "get_weather", "parameters": {"city": "Paris"}} and more', [])
    assert read(llama, "The weather is fine.") == ("The weather is fine.", [])
    assert read(mistral, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]') == (None, [paris])
    assert read(mistral, "[TOOL_CALLS] not json") == ("[TOOL_CALLS] not json", [])
    assert read(ToolChoice("auto", "hermes", parallel=False), '<tool_call>{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}</tool_call><tool_call>{"name": "get_weather", "arguments": {}}') == (None, [paris])
    assert read(ToolChoice("named", name="get_weather"), '{"city": "Paris"}') == (None, [paris])
    assert read(ToolChoice("required"), '[{"name": "get_weather", "parameters": {"city": "Paris"}}]') == (
        None, [paris])
    assert read(ToolChoice("required"), '[{"name": "get_weather", "param') == ('[{"name": "get_weather", "param', [])
    calls = hermes.read('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' * 2)[1]
    assert calls[0].id != calls[1].id and all(call.id.startswith("call_") for call in calls)
    assert [parser_of_template(template) for template in (
        "{{ '<tool_call>' }}", {"default": "x", "tool_use": "[TOOL_CALLS]"}, "<|python_tag|>", "plain", None)] == [
        "hermes", "mistral", "llama3_json", None, None]


def test_a_tool_choice_is_checked_against_the_tools_and_holds_the_answer_to_a_schema_when_asked():
    tools = [WEATHER, TIME]
    for given, choice, parser, param in [(None, "required", "hermes", "tool_choice"),
                                         ([WEATHER, WEATHER], "auto", "hermes", "tools"),
                                         (tools, {"type": "function", "function": {"name": "nope"}}, "hermes",
                                          "tool_choice.function.name"),
                                         (tools, "auto", None, "tool_choice"), (tools, None, None, "tool_choice")]:
        with pytest.raises(InvalidRequestError) as caught:
            tool_choice(given, choice, parser)
        assert caught.value.param == param, caught.value
    assert [tool_choice(None, choice, None) for choice in (None, "none")] == [None, None]
    assert tool_choice(tools, "none", None) is None
    assert tool_choice(tools, None, "mistral") == ToolChoice("auto", "mistral")
    assert tool_choice(tools, {"type": "function", "function": {"name": "get_time"}}, None) == ToolChoice(
        "named", name="get_time")
    assert ToolChoice("named", name="get_time").schema(tools) == TIME["function"]["parameters"]
    required = tool_choice(tools, "required", None, parallel=False)
    schema = required.schema(tools)
    assert (schema["minItems"], schema["maxItems"], len(schema["items"]["anyOf"])) == (1, 1, 2)
    assert schema["items"]["anyOf"][1]["properties"] == {"name": {"const": "get_time"},
                                                         "parameters": TIME["function"]["parameters"]}
    assert "maxItems" not in tool_choice(tools, "required", None).schema(tools)
    assert ToolChoice("auto").schema(tools) is None


# A chat template that shows the tools and the calls made (each call's arguments as an object).
TOOLS_TEMPLATE = (
    "{% if tools %}{{ tools | length }} tools {% endif %}"
    "{% for message in messages %}{{ message.role }} {{ message.content }} {% for call in message.tool_calls or [] %}"
    "call {{ call.function.arguments.city }} {% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}{# <tool_call> #}")


def test_tool_calls_of_an_answer_reach_the_client_whole_and_streamed_and_the_messages_reach_the_template():
    """`tools` with `tool_choice` auto: the prompt is the chat template's, given the tools and the earlier calls
    (arguments as objects) and tool answers; the answer's calls (the parser the template names: hermes) come as
    `tool_calls`, finish reason `tool_calls`; streamed, in one delta before the finish reason."""
    chat_tokenizer = TOKENIZER.__class__(tokenizer_object=TOKENIZER.backend_tokenizer, **TOKENIZER.special_tokens_map)
    chat_tokenizer.chat_template = TOOLS_TEMPLATE
    text = 'the cat <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    engine = ScriptedEngine(events=[Event(text[:20], 1), Event(text[20:], 2, "stop")], tokenizer=chat_tokenizer)
    app = build_app(engine, NAME)
    messages = [{"role": "user", "content": "paris?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = {"model": NAME, "messages": messages, "tools": [WEATHER, TIME]}
    choice = call(app, "POST", "/v1/chat/completions", json=body).json()["choices"][0]
    expected = chat_tokenizer.apply_chat_template(
        [messages[0], {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "rome"}}}]},
         {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}], tools=[WEATHER, TIME],
        add_generation_prompt=True, tokenize=False)
    assert expected.startswith("2 tools user") and "call rome" in expected
    assert engine.jobs[-1][0].prompt == chat_tokenizer(expected, add_special_tokens=False).input_ids
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "the cat"
    [found] = choice["message"]["tool_calls"]
    assert (found["type"], found["function"]) == (
        "function", {"name": "get_weather", "arguments": '{"city": "Paris"}'})
    chunks = sse(call(app, "POST", "/v1/chat/completions", json={**body, "stream": True}))
    deltas = [chunk["choices"][0] for chunk in chunks]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""} and deltas[-1]["finish_reason"] == "tool_calls"
    assert deltas[1]["delta"]["content"] == "the cat" and len(deltas) == 3
    assert [{**item, "id": None} for item in deltas[1]["delta"]["tool_calls"]] == [
        {"index": 0, "id": None, "type": "function", "function": found["function"]}]
    engine.events = [Event("it is sunny.", 1, "stop")]
    plain = call(app, "POST", "/v1/chat/completions", json=body).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"] == {"role": "assistant", "content": "it is sunny."}
    bad = call(app, "POST", "/v1/chat/completions", json={**body, "tools": [
        WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools.1.function.parameters"
    both = call(app, "POST", "/v1/chat/completions", json={**body, "tool_choice": "required",
                                                           "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "response_format"
    assert call(app, "POST", "/v1/chat/completions", json={**body, "tools": [{"type": "function", "function": {
        "name": "no spaces"}}]}).json()["error"]["param"] == "tools.0.function.name"


def test_required_and_named_tool_choices_hold_the_answer_to_the_tools_schemas(json_app):
    """`tool_choice` required: a list of calls of the tools given, each with its parameters' schema; a named
    function: its arguments; greedy, the CPU model's tokens among those the grammar allows."""
    app, cpu_model, tokenizer = json_app
    grammars = Grammars(tokenizer, len(tokenizer), {cpu_model.generation_config.eos_token_id})
    body = {"model": NAME, "messages": [{"role": "user", "content": "Time?"}], "max_tokens": 24, "temperature": 0,
            "tools": [WEATHER, TIME]}
    prompt = tokenizer.apply_chat_template(body["messages"], tools=body["tools"], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    named = {"type": "function", "function": {"name": "get_time"}}
    expected = grammar_greedy(cpu_model, tokenizer, prompt, grammars.schema(TIME["function"]["parameters"], "t"),
                              1.0, 24)
    choice = call(app, "POST", "/v1/chat/completions", json={**body, "tool_choice": named}).json()["choices"][0]
    [found] = choice["message"]["tool_calls"]
    assert found["function"] == {"name": "get_time", "arguments": tokenizer.decode(expected[:-1])}
    assert json.loads(found["function"]["arguments"])["zone"] in ("utc", "cet") and choice["finish_reason"] == "stop"
    assert choice["message"]["content"] is None
    choice = call(app, "POST", "/v1/chat/completions", json={
        **body, "tool_choice": "required", "max_tokens": 64 - len(prompt), "parallel_tool_calls": False}
    ).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    [found] = choice["message"]["tool_calls"]  # (one: parallel_tool_calls false)
    schema = ToolChoice("required", parallel=False).schema(body["tools"])
    [expected] = json.loads(tokenizer.decode(grammar_greedy(cpu_model, tokenizer, prompt, grammars.schema(schema, "t"),
                                                            1.0, 64 - len(prompt))[:-1]))
    assert found["function"] == {"name": expected["name"], "arguments": json.dumps(expected["parameters"])}


def test_the_official_client_reads_answers_held_to_a_schema_and_tool_calls(json_app):
    """The `openai` client against the application on localhost: `response_format` with a JSON schema (its own
    `parse()`, which checks the answer against a pydantic model) and a named tool choice give what the same
    requests through the ASGI transport give."""
    app, _, _ = json_app
    import openai
    import pydantic
    import uvicorn

    from testing_utils import free_port

    class Pet(pydantic.BaseModel):
        digit: int = pydantic.Field(ge=0, le=9)
        pet: Literal["cat", "dog"]

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "My pet?"}]
        parsed = client.chat.completions.parse(model=NAME, messages=messages, response_format=Pet, max_tokens=20,
                                               temperature=0).choices[0].message
        strict = Pet.model_json_schema() | {"additionalProperties": False}  # (the schema as the client sends it)
        expected = call(app, "POST", "/v1/chat/completions", json={
            "model": NAME, "messages": messages, "max_tokens": 20, "temperature": 0, "response_format": {
                "type": "json_schema", "json_schema": {"name": "Pet", "schema": strict, "strict": True}}}
        ).json()["choices"][0]
        assert parsed.content == expected["message"]["content"] and parsed.parsed == Pet.model_validate_json(
            expected["message"]["content"])
        answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0,
                                                tools=[WEATHER, TIME], tool_choice={
                                                    "type": "function", "function": {"name": "get_time"}})
        [found] = answer.choices[0].message.tool_calls
        assert found.function.name == "get_time" and json.loads(found.function.arguments)["zone"] in ("utc", "cet")
    finally:
        server.should_exit = True
        thread.join(30)
