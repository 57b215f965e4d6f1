"""Logits processors the engine's step does not apply on the device run on the host, per row, on the
same engine and graphs: Transformers' tokens, counted, and reported by `check()`."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

import optimum_neuron_torch as ont
from optimum_neuron_torch.generation import Buckets, enable_compiled_generation
from tiny_models import TINY_MODELS, VOCAB

BUCKETS = Buckets(batch_sizes=(1, 4), prompt_buckets=(8, 16), max_length=64)


class EvenTokensOnly(LogitsProcessor):
    """A caller's own processor: odd token ids are never chosen."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.index_fill(-1, torch.arange(1, scores.shape[-1], 2), float("-inf"))


class FailsAtThirdToken(LogitsProcessor):
    def __init__(self, width: int) -> None:
        self.width = width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] >= self.width + 2:
            raise ValueError("the caller's processor failed")
        return scores


@pytest.fixture(scope="module")
def llama():
    torch._dynamo.reset()
    cpu = TINY_MODELS["llama"].build()
    return cpu, enable_compiled_generation(copy.deepcopy(cpu).to("neuron"), BUCKETS)


def padded_batch(pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 5, 9 and 3 tokens, left-padded with `pad`."""
    generator = torch.Generator().manual_seed(3)
    ids, mask = torch.full((3, 9), pad, dtype=torch.long), torch.zeros((3, 9), dtype=torch.long)
    for row, length in enumerate((5, 9, 3)):
        ids[row, 9 - length:] = torch.randint(4, VOCAB, (length,), generator=generator)
        mask[row, 9 - length:] = 1
    return ids, mask


# (126: the token greedy search takes first in the first row)
@pytest.mark.parametrize("settings", [
    dict(no_repeat_ngram_size=2),
    # (holds the end-of-sequence token back; Transformers counts the new tokens from the padded width: the
    # host's processors get the rows with their padding)
    dict(min_new_tokens=5, eos_token_id=126, pad_token_id=0),
    # (the penalty runs on the host with them; Transformers' skips the padding, here of the token 126)
    dict(bad_words_ids=[[7], [9, 11]], repetition_penalty=1.3, pad=126),
    dict(logits_processor=LogitsProcessorList([EvenTokensOnly()])),
    # (a caller's own penalty reads the padding, which the device's would not: it runs on the host)
    dict(logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)]), pad=126),
], ids=["no_repeat_ngram", "min_new_tokens", "bad_words_and_penalty", "callers_processor", "callers_penalty"])
def test_greedy_tokens_with_host_processors_match_transformers_on_cpu(llama, settings):
    cpu, model = llama
    settings = dict(settings)
    ids, mask = padded_batch(settings.pop("pad", 0))
    generation = model.neuron_generation
    engine, steps = generation.engine, generation.engine.steps
    chosen = generation.host_choices.copy()
    generated = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **settings)
    expected = cpu.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **settings)
    assert generated.tolist() == expected.tolist()
    # (on the engine's steps: each token of each row chosen on the host, the first ones after the prefills)
    assert engine.steps > steps and generation.engine is engine
    eos = settings.get("eos_token_id", cpu.generation_config.eos_token_id)
    counted = generation.host_choices - chosen
    assert set(counted.values()) == {new_tokens(generated, 9, eos)}
    if any(isinstance(processor, EvenTokensOnly) for processor in settings.get("logits_processor", [])):
        assert (generated[:, 9:] % 2 == 0).all()


def new_tokens(sequences: torch.Tensor, width: int, eos: int) -> int:
    """How many tokens the rows generated: up to their end-of-sequence token, or all."""
    total = 0
    for row in sequences[:, width:].tolist():
        total += row.index(eos) + 1 if eos in row else len(row)
    return total


def test_sampling_with_a_host_processor_is_seeded_per_row(llama):
    """Sampled on the host from the row's own generator: a seed draws the same sequences, another
    seed others, a row alone draws what it draws in a batch, and no odd token comes out."""
    _, model = llama
    ids, mask = padded_batch()
    settings = dict(do_sample=True, top_k=20, max_new_tokens=10, eos_token_id=None,
                    logits_processor=LogitsProcessorList([EvenTokensOnly()]))
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        runs.append(model.generate(ids, attention_mask=mask, **settings))
    assert runs[0].tolist() == runs[1].tolist() != runs[2].tolist()
    assert (runs[0][:, 9:] % 2 == 0).all()
    torch.manual_seed(1)
    alone = model.generate(ids[:1, 4:], **settings)
    assert alone[0, 5:].tolist() == runs[0][0, 9:].tolist()


def test_sampling_on_the_host_draws_what_transformers_draws_with_the_row_s_seed(llama):
    """A row samples on the host as Transformers' loop does (the warpers, then one multinomial draw a
    token), from a generator seeded with the row's seed: Transformers on the CPU, its global generator
    seeded with that seed, draws the same tokens."""
    cpu, model = llama
    ids = padded_batch()[0][:1, 4:]
    settings = dict(do_sample=True, temperature=0.9, top_k=12, top_p=0.95, no_repeat_ngram_size=2,
                    max_new_tokens=12, eos_token_id=None)
    torch.manual_seed(5)
    seed = int(torch.randint(2**62, ()))  # (the row's seed, as `engine_calls.plan` draws it)
    torch.manual_seed(5)
    generated = model.generate(ids, **settings)
    torch.manual_seed(seed)
    assert generated.tolist() == cpu.generate(ids, **settings).tolist()


@pytest.mark.parametrize("settings", [dict(), dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2)],
                         ids=["greedy", "device_penalty", "host_processor"])
def test_scores_and_logits_come_from_the_engine_as_transformers_returns_them(llama, settings):
    """`return_dict_in_generate` with `output_scores` and `output_logits` runs on the engine (the rows'
    logits read on the host, which chooses the tokens): the rows stay in step as in Transformers'
    loop, a row that ended fed the pad token with its scores still recorded, so the sequences,
    scores and logits of every step are Transformers'. No static graph is compiled."""
    cpu, model = llama
    ids, mask = padded_batch()
    base = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, **settings)
    free = cpu.generate(ids, eos_token_id=None, **base)
    eos = int(free[0, 9 + 2])  # (the first row ends at its third token, before the others)
    asked = dict(base, eos_token_id=eos, return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected = cpu.generate(ids, **asked)
    generation = model.neuron_generation
    steps = generation.engine.steps
    output = model.generate(ids, **asked)
    assert type(output) is type(expected) and output.cache is None
    assert output.sequences.tolist() == expected.sequences.tolist()
    ended = expected.sequences[:, 9:].tolist()[0].index(eos) + 1
    assert ended < len(expected.scores)  # (the first row ended before the call: fed the pad token since)
    assert len(output.scores) == len(output.logits) == len(expected.scores)
    torch.testing.assert_close(torch.stack(output.logits), torch.stack(expected.logits), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.stack(output.scores), torch.stack(expected.scores), rtol=1e-4, atol=1e-4)
    assert generation.engine.steps > steps and not generation.static.cache_keys
    plain = model.generate(ids, **dict(base, eos_token_id=eos, return_dict_in_generate=True))
    assert plain.sequences.tolist() == expected.sequences.tolist()
    assert plain.scores is None and plain.logits is None


def test_a_failing_host_processor_fails_its_call_and_the_engine_goes_on(llama):
    cpu, model = llama
    ids, mask = padded_batch()
    with pytest.raises(ValueError, match="the caller's processor failed"):
        model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                       logits_processor=LogitsProcessorList([FailsAtThirdToken(ids.shape[1])]))
    generation = model.neuron_generation
    assert generation.engine_gap is None and generation.engine.busy_slots == 0
    generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, no_repeat_ngram_size=2)
    expected = cpu.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, no_repeat_ngram_size=2)
    assert generated.tolist() == expected.tolist()


def test_check_names_the_processors_the_host_runs_and_counts_their_tokens(llama):
    _, model = llama
    model.generation_config.no_repeat_ngram_size = 3
    try:
        model.generate(padded_batch()[0][:1, 4:], max_new_tokens=4, do_sample=False)
        report = ont.check(model, compile=False)
    finally:
        model.generation_config.no_repeat_ngram_size = None
    text = report.render()
    assert "NoRepeatNGramLogitsProcessor" in report.host_processors[0]
    assert any(line.startswith("NoRepeatNGramLogitsProcessor: ") and "token(s) chosen on the host" in line
               for line in report.host_processors)
    assert "Generation: logits processors run on the host" in text
    assert not ont.check(model, compile=False).host_processors[0].startswith("the generation config")


def test_threads_mixing_host_and_device_choices_share_steps_and_get_what_each_gets_alone(llama, monkeypatch):
    """Three threads at once, a prompt each: plain greedy search (chosen on the device), a caller's
    processor that fails at its third token, and `no_repeat_ngram_size` (both on the host): their rows
    share decode steps; the failing call raises its own error, the others get the CPU's tokens, on the
    engine still."""
    cpu, model = llama
    ids, _ = padded_batch()
    prompts = [ids[0:1, 4:], ids[1:2], ids[2:3, 6:]]
    settings = [dict(), dict(logits_processor=LogitsProcessorList([FailsAtThirdToken(prompts[1].shape[1])])),
                dict(no_repeat_ngram_size=2)]
    expected = {index: cpu.generate(prompts[index], max_new_tokens=10, do_sample=False, **settings[index]).tolist()
                for index in (0, 2)}
    engine = model.neuron_generation.engine
    steps = engine.steps
    for index in (0, 2):  # (alone, one after the other)
        model.generate(prompts[index], max_new_tokens=10, do_sample=False, **settings[index])
    alone, steps = engine.steps - steps, engine.steps
    start, answers = threading.Barrier(3), {}
    # The first turn waits until the three calls are queued: a thread that reached the barrier first could
    # otherwise run its whole call before the others are scheduled (seen on a loaded 2-core machine: no
    # step shared), which tests the scheduler of the machine, not the engine's.
    turn, queued = engine._turn, threading.Event()

    def first_turn_waits_for_every_call(wait: bool = True) -> bool:
        deadline = time.monotonic() + 60
        while not queued.is_set() and engine.waiting < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        queued.set()
        return turn(wait)

    monkeypatch.setattr(engine, "_turn", first_turn_waits_for_every_call)

    def call(index: int) -> None:
        start.wait()
        try:
            answers[index] = model.generate(prompts[index], max_new_tokens=10, do_sample=False,
                                            **settings[index]).tolist()
        except ValueError as error:
            answers[index] = str(error)

    threads = [threading.Thread(target=call, args=(index,)) for index in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert answers == {**expected, 1: "the caller's processor failed"}
    # (the rows of the calls that run to their end share steps: fewer than alone, one call after the other)
    assert engine.steps - steps < alone and engine.busy_slots == 0
    assert model.neuron_generation.engine_gap is None  # (no call left the engine for the static graphs)
