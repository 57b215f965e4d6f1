"""Speculative decoding (`generation.speculation`): prompt lookup and a draft model propose tokens, one verify
graph checks them; the answers are Transformers' greedy ones on the CPU, whatever was drafted."""

from __future__ import annotations

import threading

import pytest
import torch

import optimum_neuron_torch as ont
from optimum_neuron_torch.compiler import cache_stats
from optimum_neuron_torch.errors import ConfigurationError
from optimum_neuron_torch.generation.buckets import Buckets, engine_plan
from optimum_neuron_torch.generation.engine import GenerationEngine
from optimum_neuron_torch.generation.requests import Request, SamplingSettings
from optimum_neuron_torch.generation.speculation import NgramDrafter, Speculation, SpeculativeConfig
from optimum_neuron_torch.serving.metrics import ServerMetrics
from testing_utils import wait_loaded
from tiny_models import VOCAB, noisy_llama

BUCKETS = Buckets((1, 2), (16, 48), 128, (128,))  # (one context bucket: 8 graphs, and a verify graph)
REPEATING = [5, 6, 7, 8, 9] * 6  # (a prompt whose answer the tiny model makes repetitive too)


def test_prompt_lookup_drafts_what_followed_the_latest_occurrence_of_the_longest_ending():
    drafter = NgramDrafter(longest=3, shortest=2)
    assert drafter.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3], 3) == [7, 8, 2]  # ([2, 3] latest: after 8)
    assert drafter.propose([1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 2) == [9, 2]  # ([1, 2, 3] before [2, 3])
    assert drafter.propose([1, 2, 3, 4, 5, 1, 2], 8) == [3, 4, 5, 1, 2]  # (what there is, up to the end)
    assert drafter.propose([1, 2, 3, 4, 3], 4) == []  # (one token matched: below the shortest)
    assert NgramDrafter(longest=2, shortest=1).propose([1, 2, 3, 4, 3], 4) == [4, 3]
    assert drafter.propose([4], 4) == [] and drafter.propose([], 4) == []


def test_a_speculative_config_names_the_field_it_refuses():
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 6}').num_speculative_tokens == 6
    for text, named in [('{"method": "eagle"}', "eagle"), ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
                        ('{"prompt_lookup_min": 4}', "prompt_lookup_min"), ('{"draft": "x"}', "unknown field"),
                        ('{"method": "draft_model"}', "needs `model`"), ("[1]", "JSON object"), ("{", "not JSON")]:
        with pytest.raises(ConfigurationError, match=named):
            SpeculativeConfig.from_json(text)


def test_the_plan_has_a_verify_graph_of_k_plus_one_tokens_per_context_bucket():
    buckets = Buckets((1, 2), (16, 48), 128, (4, 64, 128))
    verify = [(graph.batch, graph.tokens, graph.context) for graph in engine_plan(buckets, speculative_tokens=4)
              if graph.role == "verify"]
    assert verify == [(1, 5, 64), (1, 5, 128)]  # (not over 4 positions, which 5 tokens pass)
    assert not [graph for graph in engine_plan(buckets) if graph.role == "verify"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny Llama on the CPU and on `neuron` (128 positions), and another of the same vocabulary (a draft)."""
    cpu_model = noisy_llama(max_position_embeddings=128)
    folder = tmp_path_factory.mktemp("tiny-llama")
    cpu_model.save_pretrained(folder)
    other = noisy_llama(max_position_embeddings=128, num_hidden_layers=1)
    draft_folder = tmp_path_factory.mktemp("draft")
    other.save_pretrained(draft_folder)
    return (cpu_model, ont.NeuronAutoModelForCausalLM.from_pretrained(folder),
            ont.NeuronAutoModelForCausalLM.from_pretrained(draft_folder))


def serving(model, speculation: Speculation) -> GenerationEngine:
    engine = GenerationEngine(model, BUCKETS, speculation=speculation)
    engine.start(show_progress=False)
    wait_loaded(engine, timeout=900)
    return engine


def answer(engine: GenerationEngine, *prompts: list[int], new_tokens: int | list[int] = 40,
           sampling: dict | None = None, **options) -> list[Request]:
    """Submits the prompts at once (each with its `new_tokens`) and waits for their answers; each request keeps
    its events (`request.events`)."""
    done = [threading.Event() for _ in prompts]
    counts = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    requests = []
    for prompt, count, ended in zip(prompts, counts, done, strict=True):
        request = Request(list(prompt), count, SamplingSettings(**(sampling or {})), [], lambda event: None, **options)
        request.events = []
        request.on_event = lambda event, request=request, ended=ended: (
            request.events.append(event), ended.set() if event.finish_reason else None)
        requests.append(request)
    for request in requests:
        engine.submit(request)
    assert all(ended.wait(300) for ended in done)
    return requests


def expected(cpu_model, request: Request) -> list[int]:
    with torch.no_grad():
        output = cpu_model.generate(torch.tensor([request.prompt]), max_new_tokens=request.max_tokens, do_sample=False)
    return output[0, len(request.prompt):].tolist()


@pytest.fixture(scope="module")
def lookup(models):
    """An engine speculating with prompt lookup (4 tokens, from 1 matched token: it drafts at most steps)."""
    engine = serving(models[1], Speculation(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1)))
    yield engine
    engine.stop(60)


def test_prompt_lookup_answers_as_transformers_greedy_on_the_cpu_with_fewer_steps(models, lookup):
    """Drafts are taken where they are the model's own greedy tokens: the answer is Transformers', in fewer
    device calls than tokens; nothing compiles after the warm-up; `/metrics` counts the drafts."""
    cpu_model, speculation = models[0], lookup.speculation
    before, calls = (cache_stats().misses, cache_stats().hits), speculation.steps
    [request] = answer(lookup, REPEATING)
    assert request.tokens == expected(cpu_model, request)
    steps = speculation.steps - calls
    assert steps > 0 and speculation.accepted > 0 and lookup.steps + steps < len(request.tokens) - 1
    assert (cache_stats().misses, cache_stats().hits) == before
    scraped = ServerMetrics(lookup).registry
    assert [scraped.get_sample_value(f"optimum_neuron_torch:spec_decode_num_{name}") for name in
            ("drafts", "draft_tokens", "accepted_tokens")] == [speculation.steps, speculation.drafted,
                                                                speculation.accepted]


def test_requests_decoding_together_or_sampling_are_not_speculated(models, lookup, monkeypatch):
    """A verify step runs for a request decoding alone: two requests decode together until the shorter ends,
    then the other is speculated; a sampled request, or one with penalties, is not."""
    cpu_model, speculation = models[0], lookup.speculation
    decoding, forward = [], lookup.device.forward

    def counted(*step, **options):
        if options.get("verify"):
            decoding.append(sum(request is not None and not request.prefilling and not request.cancelled
                                for request in lookup._slots))
        return forward(*step, **options)

    monkeypatch.setattr(lookup.device, "forward", counted)
    first, second = answer(lookup, REPEATING, REPEATING[3:], new_tokens=[8, 30])
    assert first.tokens == expected(cpu_model, first) and second.tokens == expected(cpu_model, second)
    assert decoding and set(decoding) == {1}
    calls = speculation.steps
    [request] = answer(lookup, REPEATING, new_tokens=20, sampling=dict(temperature=0.7, seed=3))
    [penalized] = answer(lookup, REPEATING, new_tokens=20, sampling=dict(repetition_penalty=1.3))
    assert speculation.steps == calls and len(request.tokens) == len(penalized.tokens) == 20


@pytest.fixture(scope="module")
def itself(models):
    """An engine whose draft model is the served model itself: every draft is the model's greedy token."""
    engine = serving(models[1], Speculation(SpeculativeConfig("draft_model", model="itself"), models[1]))
    yield engine
    engine.stop(60)


@pytest.mark.slow  # (an engine with a draft model's graphs too)
def test_a_draft_model_as_the_model_itself_has_every_draft_taken(models, itself, monkeypatch):
    """A draft model proposes its own greedy tokens: drafting with the served model itself, every one is taken;
    answers to prompts one after another are Transformers'; the draft's cache is prefilled once per prompt (a long
    one in chunks; one of fewer tokens than a step drafts is fed as the tokens taken are), then fed the tokens
    taken since its last proposal, a decode step each."""
    cpu_model, speculation = models[0], itself.speculation
    drafter = speculation.drafter
    calls, run = [], drafter.device.run
    monkeypatch.setattr(drafter.device, "run", lambda ids, positions, *rest, **options: (
        calls.append((len(ids[0]), positions[0][0])), run(ids, positions, *rest, **options))[1])
    steps, drafted = speculation.steps, speculation.drafted
    # (each prompt's: its bucket, or chunks of 48; a prompt of 2 tokens is fed by 2 decode steps)
    pieces = [[(48, 0)], [(48, 0), (48, 48)], []]
    for prompt, prompt_pieces in zip((REPEATING, list(range(3, 70)), [9, 4]), pieces, strict=True):
        calls.clear()
        [request] = answer(itself, prompt, new_tokens=30)
        assert request.tokens == expected(cpu_model, request)
        prefills = [call for call in calls if call[0] > 1]
        assert prefills == prompt_pieces
        assert len(calls) - len(prefills) <= 30 + 4  # (a decode step per token drafted or taken, not the prompt's)
    assert speculation.drafted > drafted and speculation.accepted == speculation.drafted
    assert speculation.steps - steps == 3 * 6 and itself.steps == 0  # (29 tokens after the first, 5 a step)


@pytest.mark.slow
def test_speculation_keeps_to_the_budget_the_cache_and_the_logprobs(models, itself):
    """No token is drafted past a request's last (1, 2, 3 new tokens: 0, 0, 1 drafted); one ending at the cache's
    last position finishes by decode steps where a verify step's k + 1 positions do not fit; log-probabilities
    are those of the raw logits at each position a verify step took."""
    cpu_model, speculation = models[0], itself.speculation
    for tokens, drafts in ((1, 0), (2, 0), (3, 1)):
        drafted = speculation.drafted
        [request] = answer(itself, REPEATING, new_tokens=tokens)
        assert request.tokens == expected(cpu_model, request) and speculation.drafted - drafted == drafts
    steps, decode_steps = speculation.steps, itself.steps
    [request] = answer(itself, (REPEATING * 4)[:119], new_tokens=9)  # (positions 119 to 127: the cache's last)
    assert request.tokens == expected(cpu_model, request)
    assert speculation.steps - steps == 1 and itself.steps - decode_steps == 3  # (5 tokens, then 3 decode steps)
    steps = itself.speculation.steps
    [request] = answer(itself, REPEATING, new_tokens=12, logprobs=3)
    assert request.tokens == expected(cpu_model, request) and itself.speculation.steps > steps
    with torch.no_grad():
        logits = cpu_model(torch.tensor([request.prompt + request.tokens])).logits[0, len(request.prompt) - 1:-1]
    logprobs = logits.log_softmax(-1)
    given = [entry for event in request.events for entry in event.logprobs]
    assert [entry.token for entry in given] == request.tokens
    torch.testing.assert_close(torch.tensor([entry.logprob for entry in given]),
                               logprobs.gather(-1, torch.tensor(request.tokens)[:, None])[:, 0], atol=1e-4, rtol=0)
    assert [[token for token, _ in entry.top] for entry in given] == logprobs.topk(3).indices.tolist()


@pytest.mark.slow  # (a third engine, with the other draft model's graphs)
def test_another_draft_model_changes_the_steps_not_the_answer(models):
    cpu_model, model, draft = models
    engine = serving(model, Speculation(SpeculativeConfig("draft_model", model="draft", num_speculative_tokens=3),
                                        draft))
    try:
        for prompt in (REPEATING, list(range(3, 70))):
            [request] = answer(engine, prompt, new_tokens=30)
            assert request.tokens == expected(cpu_model, request)
        assert engine.speculation.steps > 0 and engine.speculation.accepted < engine.speculation.drafted
    finally:
        engine.stop(60)


def test_a_draft_model_of_another_vocabulary_or_a_split_model_is_refused(models, tmp_path):
    other = noisy_llama(max_position_embeddings=128, vocab_size=VOCAB + 64)
    other.save_pretrained(tmp_path)
    draft = ont.NeuronAutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ConfigurationError, match=f"{VOCAB + 64} tokens, the served model's {VOCAB}"):
        GenerationEngine(models[1], BUCKETS, speculation=Speculation(SpeculativeConfig("draft_model", model="x"),
                                                                     draft))
    with pytest.raises(ConfigurationError, match="split between ranks"):
        GenerationEngine(models[1], BUCKETS, broadcast=object(), speculation=Speculation(SpeculativeConfig()))
