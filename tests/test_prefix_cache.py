"""Automatic prefix caching (`generation.prefix_cache`): where a prompt goes among the slots, and the engine's
answers with the keys and values of a prompt's first tokens reused, equal to Transformers' on the CPU."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import optimum_neuron_torch as ont
from optimum_neuron_torch.compiler import cache_stats
from optimum_neuron_torch.errors import ConfigurationError
from optimum_neuron_torch.generation.buckets import Buckets, PlannedGraph, engine_plan
from optimum_neuron_torch.generation.engine import GenerationEngine
from optimum_neuron_torch.generation.prefix_cache import BLOCK, PrefixCache
from optimum_neuron_torch.generation.requests import Request, SamplingSettings
from optimum_neuron_torch.generation.slots import dummy_step
from optimum_neuron_torch.serving.metrics import ServerMetrics
from testing_utils import wait_loaded
from tiny_models import VOCAB, noisy_llama


def tokens(seed: int, count: int) -> list[int]:
    return [(seed * index + 3) % VOCAB for index in range(count)]


def test_a_prompt_goes_to_the_slot_holding_its_start_else_to_the_least_recently_used():
    cache = PrefixCache(3)
    first, other = tokens(7, 40), tokens(11, 40)
    assert cache.place(first, [0, 1, 2]) == (0, None, 0)  # (nothing held: the least recently used, the lowest)
    cache.written(0, first)
    assert cache.matched(0, first + [1]) == 32 and cache.matched(0, first) == 32  # (whole blocks, one left)
    assert cache.matched(0, first[:BLOCK] + [1]) == BLOCK and cache.matched(0, first[:BLOCK]) == 0
    assert cache.place(other, [1, 2]) == (1, None, 0)  # (slot 0 busy; 1 and 2 never used: the lowest)
    cache.written(1, other)
    assert cache.place(first + [5], [2]) == (2, 0, 32)  # (slot 0 holds its start but is busy: copied from it)
    assert cache.held[2] == first[:32]  # (what stays valid until its prefill writes the rest)
    assert cache.place(other + [5], [0, 1]) == (1, None, 32)  # (free and holding its start: no copy)
    assert cache.place(tokens(13, 20), [0]) == (0, None, 0) and cache.held[0] == []  # (evicted: slot 0 reused)
    assert cache.place(other + [6], [0, 2], reuse=False) == (2, None, 0)  # (a prompt scored whole: nothing reused)
    assert (cache.queried, cache.hits) == (40 + 40 + 41 + 41 + 20 + 41, 64)
    cache.written(0, first)
    cache.written(1, other)
    cache.overwritten(range(1), 20)  # (a step on pad tokens wrote the first slot from position 20 on)
    assert cache.held == [first[:20], other, []]


def test_the_plan_has_a_suffix_graph_per_prompt_bucket_and_context_beyond_it_but_the_chunks():
    buckets = Buckets((1, 2), (16, 48), 128, (64, 128))
    added = [(graph.tokens, graph.context) for graph in engine_plan(buckets, prefix_caching=True)
             if graph.role == "suffix"]
    chunks = [(graph.tokens, graph.context) for graph in engine_plan(buckets) if graph.role == "chunk"]
    assert chunks == [(48, 128)] and added == [(16, 64), (16, 128), (48, 64)]


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """An engine of 2 slots and 128 positions, prompt buckets 16 and 48, context buckets 64 and 128, with prefix
    caching: (engine, CPU model)."""
    cpu_model = noisy_llama(max_position_embeddings=128)
    folder = tmp_path_factory.mktemp("tiny-llama")
    cpu_model.save_pretrained(folder)
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder)
    engine = GenerationEngine(model, Buckets((1, 2), (16, 48), 128, (64, 128)), prefix_caching=True)
    engine.start(show_progress=False)
    wait_loaded(engine, timeout=600)
    yield engine, cpu_model
    engine.stop(60)


def answer(engine: GenerationEngine, *prompts: list[int], new_tokens: int | list[int] = 8,
           **sampling) -> list[Request]:
    """Submits the prompts at once (each with its `new_tokens`) and waits for their answers."""
    done = [threading.Event() for _ in prompts]
    counts = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    requests = [Request(list(prompt), count, SamplingSettings(**sampling), [],
                        lambda event, ended=ended: ended.set() if event.finish_reason else None)
                for prompt, count, ended in zip(prompts, counts, done, strict=True)]
    for request in requests:
        engine.submit(request)
    assert all(ended.wait(120) for ended in done)
    return requests


def expected(cpu_model, request: Request, **options) -> list[int]:
    with torch.no_grad():
        output = cpu_model.generate(torch.tensor([request.prompt]), max_new_tokens=request.max_tokens,
                                    do_sample=False, **options)
    return output[0, len(request.prompt):].tolist()


def test_prompts_that_start_alike_reuse_the_keys_and_values_and_answer_as_transformers(cached, monkeypatch):
    """A prompt whose first tokens a slot holds is prefilled from there only (a `suffix` piece), whether the slot is
    free (its own) or busy (its positions copied); the answers are Transformers' greedy ones on the CPU, with the
    repetition penalty reading the reused prompt tokens (not the slot's previous request's); nothing compiles."""
    engine, cpu_model = cached
    pieces, copies, run, reuse = [], [], engine.device.run, engine.device.reuse
    monkeypatch.setattr(engine.device, "run", lambda ids, positions, *rest: (
        pieces.append((positions[0][0], len(ids[0]))) if len(ids[0]) > 1 else None, run(ids, positions, *rest))[1])
    monkeypatch.setattr(engine.device, "reuse", lambda slot, donor, prefix: (
        copies.append((donor, len(prefix))), reuse(slot, donor, prefix))[1])
    before, hits = cache_stats().misses, engine.prefixes.hits
    first = tokens(7, 40)
    [request] = answer(engine, first, repetition_penalty=1.3)  # (the step counts what it generates in the slot)
    assert request.tokens == expected(cpu_model, request, repetition_penalty=1.3) and pieces == [(0, 48)]
    [again] = answer(engine, first, repetition_penalty=1.3)  # (its slot's count starts from its own prompt again)
    assert again.tokens == request.tokens and pieces == [(0, 48), (32, 16)]
    pieces.clear()
    [request] = answer(engine, first + tokens(5, 20), repetition_penalty=1.3)
    assert request.tokens == expected(cpu_model, request, repetition_penalty=1.3)
    assert pieces == [(32, 48)] and copies[-1] == (None, 32)  # (its own slot: 2 blocks reused, 28 tokens prefilled)
    pieces.clear()
    # A long answer keeps its slot busy while a prompt starting alike arrives: copied into the other slot.
    started, ended = threading.Event(), threading.Event()
    busy = Request(first[:36] + [1, 2, 3], 50, SamplingSettings(), [],
                   lambda event: (started.set(), ended.set() if event.finish_reason else None))
    engine.submit(busy)
    assert started.wait(120)
    [request] = answer(engine, first[:36] + [4, 5], repetition_penalty=1.3)
    assert ended.wait(120) and busy.tokens == expected(cpu_model, busy)
    assert request.tokens == expected(cpu_model, request, repetition_penalty=1.3)
    assert copies[-1][1] == 32 and copies[-1][0] is not None and copies[-1][0] == busy._slot != request._slot
    # A short answer in slot 0 (the least recently used) and a long one in slot 1: while slot 0 is free, holding
    # its prompt, the decode steps of 2 rows throw its row away without writing over that prompt's positions.
    short, long = answer(engine, tokens(13, 40), tokens(17, 40), new_tokens=[2, 30])
    assert (short._slot, long._slot) == (0, 1) and long.tokens == expected(cpu_model, long)
    [request] = answer(engine, short.prompt[:35] + [8])
    assert request._slot == 0 and request.tokens == expected(cpu_model, request)
    assert engine.prefixes.hits - hits == 32 * 5
    assert cache_stats().misses == before
    scraped = ServerMetrics(engine).registry
    assert [scraped.get_sample_value(f"optimum_neuron_torch:prefix_cache_{name}") for name in ("queries", "hits")] == [
        engine.prefixes.queried, engine.prefixes.hits]


def test_a_free_slot_in_a_decode_step_forgets_its_prompt_from_the_position_the_step_writes(cached):
    """A free slot among the rows of a decode step writes the step's last position (63 with 64 positions): a prompt
    of 70 tokens it held is reused up to there only (48 tokens, whole blocks), and the answer is Transformers'."""
    engine, cpu_model = cached
    engine.prefixes.used = [0, 1]  # (slot 0 the least recently used: the long prompt goes there, the short to 1)
    long, short = answer(engine, tokens(29, 70), tokens(31, 20), new_tokens=[1, 30])
    assert (long._slot, short._slot) == (0, 1) and engine.prefixes.held[0] == long.prompt[:63]
    hits = engine.prefixes.hits
    [request] = answer(engine, long.prompt[:68] + [5])
    assert request._slot == 0 and engine.prefixes.hits - hits == 48
    assert request.tokens == expected(cpu_model, request)


def test_a_graph_loaded_while_idle_forgets_only_the_positions_its_pad_tokens_wrote(cached):
    """A graph the compile cache held loads when the engine is idle, on pad tokens (`dummy_step`): a prefill's in
    slot 0 from position 0, a decode step's in the first slots at the last position of its context (the cache's
    last here, which no prompt reaches)."""
    engine, _ = cached
    held = [tokens(19, 60), tokens(23, 60)]
    engine.prefixes.held = [list(prompt) for prompt in held]
    with engine._condition:
        engine._unloaded.extend([dummy_step(PlannedGraph("decode", 2, 1, 128), engine.pad_token_id),
                                 dummy_step(PlannedGraph("prefill", 1, 16, 16), engine.pad_token_id)])
        engine._condition.notify()
    deadline = time.monotonic() + 60
    while engine.graphs_unloaded and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.prefixes.held == [[], held[1]]  # (slot 1's prompt kept: the decode step wrote position 127)


def test_prefix_caching_is_refused_for_a_model_split_between_ranks(cached):
    engine, _ = cached
    with pytest.raises(ConfigurationError, match="split between ranks"):
        GenerationEngine(engine.model, engine.buckets, broadcast=object(), prefix_caching=True)
