"""Compiled generation: token-identical to Transformers' eager generate() on the CPU, on a fixed set
of graphs, with no recompile after warm-up."""

from __future__ import annotations

import copy
import random
import string
import threading
import warnings

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    AutoModelForCausalLM,
    CpmAntConfig,
    FalconConfig,
    GPTBigCodeConfig,
    InklingTextConfig,
    MambaConfig,
    MBartConfig,
    MiMoV2FlashConfig,
    PreTrainedTokenizerFast,
    RwkvConfig,
    TextStreamer,
    TrOCRConfig,
)
from transformers.generation.streamers import BaseStreamer

from optimum_neuron_torch import NeuronAutoModelForCausalLM
from optimum_neuron_torch.device import reference
from optimum_neuron_torch.generation import (
    Buckets,
    describe_plan,
    disable_compiled_generation,
    enable_compiled_generation,
)
from optimum_neuron_torch.patches import apply_patches
from testing_utils import clear_counts, graphs, recompiles
from tiny_models import PROGRAMS_PER_GRAPH, TINY_MODELS, VOCAB

BUCKETS = Buckets(batch_sizes=(1, 4), prompt_buckets=(8, 16), max_length=64)
GREEDY = dict(do_sample=False)
# Architectures whose generation tests run in the slow tier only (the fast tier runs Llama and Mistral).
SLOW_ARCHITECTURES = [pytest.param(name, marks=pytest.mark.slow) for name in ("qwen2", "gemma2", "gpt2")]


def compiled(name: str, buckets: Buckets = BUCKETS, **config_changes):
    """(CPU model, compiled-generation model on the device) of a tiny architecture."""
    tiny = TINY_MODELS[name]
    cpu = tiny.build()
    for key, value in config_changes.items():
        setattr(cpu.config, key, value)
    return cpu, enable_compiled_generation(copy.deepcopy(cpu).to("neuron"), buckets)


def prompt(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama():
    """A tiny Llama with compiled generation, warmed up on every graph of BUCKETS."""
    torch._dynamo.reset()
    cpu, model = compiled("llama")
    model.precompile(show_progress=False)
    return cpu, model


@pytest.mark.parametrize("name", ["llama", "mistral", *SLOW_ARCHITECTURES])
def test_greedy_tokens_match_transformers_eager_on_cpu(name, fresh_dynamo):
    cpu, model = compiled(name, Buckets((1,), (8, 16), 64))
    for length, new_tokens in ((5, 8), (13, 10)):
        ids = prompt(length, seed=length)
        expected = cpu.generate(ids, max_new_tokens=new_tokens, **GREEDY)
        generated = model.generate(ids.to("neuron"), max_new_tokens=new_tokens, **GREEDY)
        assert generated.device.type == "neuron"
        assert generated.cpu().tolist() == expected.tolist()
    assert graphs() == 3  # prefill 8, prefill 16, decode


def test_sliding_window_attention_matches_eager(fresh_dynamo):
    """Gemma2 with a window shorter than the prompt: the full static layer under the sliding mask
    computes what Transformers' sliding cache does."""
    cpu, model = compiled("gemma2", Buckets((1,), (16,), 64), sliding_window=6)
    ids = prompt(12, seed=3)
    expected = cpu.generate(ids, max_new_tokens=12, **GREEDY)
    assert model.generate(ids.to("neuron"), max_new_tokens=12, **GREEDY).cpu().tolist() == expected.tolist()


@pytest.mark.slow  # (the fast tier generates with an encoder-decoder in test_pipelines.py's text2text test)
def test_seq2seq_tokens_match_transformers_eager_on_cpu(fresh_dynamo):
    cpu, model = compiled("t5", Buckets((1, 2), (8, 16), 32))
    for batch, length in ((1, 5), (1, 7), (2, 12)):
        ids = prompt(length, batch, seed=length)
        expected = cpu.generate(ids, max_new_tokens=6, **GREEDY)
        assert model.generate(ids.to("neuron"), max_new_tokens=6, **GREEDY).cpu().tolist() == expected.tolist()


def test_no_recompile_after_warm_up(llama):
    """30 prompts of random lengths up to the largest bucket, three max_new_tokens: no new graph."""
    cpu, model = llama
    clear_counts()
    rng = random.Random(0)
    for index in range(30):
        ids = prompt(rng.randint(1, 16), seed=index)
        new_tokens = (3, 9, 17)[index % 3]
        generated = model.generate(ids.to("neuron"), max_new_tokens=new_tokens, **GREEDY)
        if index % 10 == 0:
            assert generated.cpu().tolist() == cpu.generate(ids, max_new_tokens=new_tokens, **GREEDY).tolist()
    assert graphs() == 0 and recompiles() == 0


def test_warm_up_compiles_one_graph_per_bucket(fresh_dynamo):
    _, model = compiled("llama", Buckets((1, 4), (8, 16), 64))
    model.precompile(show_progress=False)
    # A prefill per prompt bucket, the chunk of a longer prompt, a decode step per batch bucket.
    assert describe_plan(model.neuron_generation.graph_plan()) == "5 graphs: 2 prefill, 1 chunk, 2 decode"
    assert graphs() == 5


def test_warm_up_with_sampling_compiles_the_decode_steps_that_sample():
    # (shapes no other test compiles, and no Dynamo reset: Dynamo's graphs of the compiled step serve
    # every model of the same shapes, among them the module's warmed-up `llama`)
    _, model = compiled("llama", Buckets((1,), (8,), 40))
    clear_counts()
    model.precompile(show_progress=False, sampling=True)
    assert graphs() == 4  # the prefill, a chunk, the decode step, and the decode step that samples
    assert len(model.neuron_generation.graph_plan(sampling=True)) == 4
    clear_counts()
    model.generate(prompt(5), max_new_tokens=6, do_sample=True, temperature=0.7, top_p=0.9)
    assert graphs() == 0 and recompiles() == 0


def test_threads_generating_on_one_model_at_once_get_what_each_gets_alone(llama):
    """Four threads of a web app calling generate() on one model at once: each gets the tokens it gets
    alone (the CPU's), on the warmed graphs. Before the calls were serialized, most answers differed."""
    cpu, model = llama
    prompts = [prompt(length, batch, seed=length) for length, batch in ((3, 1), (7, 1), (11, 4), (14, 1))]
    expected = [cpu.generate(ids, max_new_tokens=12, **GREEDY).tolist() for ids in prompts]
    clear_counts()
    start, answers = threading.Barrier(len(prompts)), {}

    def call(index: int) -> None:
        start.wait()
        for _ in range(2):
            ids = prompts[index].to("neuron")
            answers.setdefault(index, []).append(model.generate(ids, max_new_tokens=12, **GREEDY).cpu().tolist())

    threads = [threading.Thread(target=call, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert {index: answers.get(index) for index in range(len(prompts))} == {
        index: [tokens, tokens] for index, tokens in enumerate(expected)}
    assert graphs() == 0 and recompiles() == 0


def test_chunked_prefill_of_a_long_prompt_matches_eager(llama):
    cpu, model = llama
    clear_counts()
    ids = prompt(48, seed=7)  # 3x the largest bucket
    expected = cpu.generate(ids, max_new_tokens=8, **GREEDY)
    assert model.generate(ids.to("neuron"), max_new_tokens=8, **GREEDY).cpu().tolist() == expected.tolist()
    assert graphs() == 0  # chunks run the largest bucket's graph


def test_padded_batch_matches_one_by_one(llama):
    """Three prompts of different lengths, left-padded by the caller, in a batch bucket of 4."""
    cpu, model = llama
    lengths = (3, 9, 14)
    ids = torch.zeros((3, 14), dtype=torch.long)
    mask = torch.zeros((3, 14), dtype=torch.long)
    singles = []
    for row, length in enumerate(lengths):
        single = prompt(length, seed=row)
        ids[row, 14 - length:], mask[row, 14 - length:] = single[0], 1
        singles.append(model.generate(single.to("neuron"), max_new_tokens=6, **GREEDY)[0, length:].cpu())
    batch = model.generate(ids.to("neuron"), attention_mask=mask.to("neuron"), max_new_tokens=6, **GREEDY).cpu()
    assert batch.shape == (3, 20)
    for row, single in enumerate(singles):
        assert batch[row, 14:].tolist() == single.tolist()
    assert batch.tolist() == cpu.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY).tolist()


def test_the_rows_of_a_call_decode_together_and_a_call_larger_than_the_slots_finishes(llama):
    """The prompts of one generate() call are prefilled one by one, then decode together: every decode
    step holds all of them (no graph for fewer rows is run, nor compiled by a call that was not
    precompiled). A call of more prompts than slots (5, 4 slots) still finishes: the fifth waits for a slot,
    and starts alone (its call's other rows are decoding, not prefilling)."""
    cpu, model = llama
    seen = engine_steps(model)
    for batch in (3, 5):
        ids = prompt(6, batch, seed=batch)
        settings = dict(max_new_tokens=5, eos_token_id=None, **GREEDY)
        assert model.generate(ids.to("neuron"), **settings).cpu().tolist() == cpu.generate(ids, **settings).tolist()
        decode_rows = [rows for rows, tokens, _ in seen if tokens == 1]
        prefills = sum(tokens > 1 for _, tokens, _ in seen)
        assert prefills == batch
        # 4 decode steps of the 4 slots (the call's 3 or first 4 rows); the fifth row's 4, alone
        assert decode_rows == [4] * 4 + [1] * 4 * (batch - 4), (batch, seen)
        seen.clear()


def test_greedy_steps_and_a_repetition_penalty_move_the_chosen_tokens_only(llama):
    """Greedy search, with or without Transformers' repetition penalty (applied in the step, from the
    token counts of each slot), moves each step's chosen tokens to the host, 8 bytes a row, never
    the logits; asked for scores, the logits cross (and the host chooses). All give
    Transformers' tokens (and scores)."""
    cpu, model = llama
    # (prompts whose greedy tokens change along the sequence, to a larger token id and to a smaller)
    ids, new_tokens = prompt(5, batch=3, seed=6), 7
    moved = {}
    for name, settings in (("greedy", GREEDY), ("penalized", dict(GREEDY, repetition_penalty=1.5))):
        model.generate(ids, max_new_tokens=2, **settings)  # (the step that penalizes compiles on first use)
        reference.clear_transfer_counts()
        generated = model.generate(ids, max_new_tokens=new_tokens, **settings)
        moved[name] = reference.transfer_counts()
        assert generated.tolist() == cpu.generate(ids, max_new_tokens=new_tokens, **settings).tolist()
    # (3 prefills and a decode step per token at most, each reading its tokens back: 8 bytes a row of
    # the batch bucket, where the logits would be 4 * VOCAB bytes a row)
    assert moved["penalized"] == moved["greedy"]
    assert moved["greedy"]["device_to_host_bytes"] <= (3 + new_tokens) * 4 * 8

    scored = dict(GREEDY, max_new_tokens=4, output_scores=True, return_dict_in_generate=True)
    output, expected = model.generate(ids, **scored), cpu.generate(ids, **scored)
    assert output.sequences.tolist() == expected.sequences.tolist()
    torch.testing.assert_close(torch.stack(output.scores), torch.stack(expected.scores), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("length", [5, 8])  # (8: the bucket's length, no padding: Transformers drops the mask)
@pytest.mark.parametrize("settings", [GREEDY, dict(do_sample=True, temperature=0.8, top_k=8, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_a_decode_step_moves_its_inputs_and_tokens_only_with_one_synchronization(llama, length, settings):
    """Each decode step of a batch bucket of 4 rows moves, per row, its token id, its position, its
    sampling row (9 x 4 bytes: warpers, penalties, whether its token counts) and a uniform number (4
    bytes), and the index of the logits kept (8 bytes), to the device, and its token (8 bytes) back:
    one synchronization a step, greedy or sampled."""
    _, model = llama
    ids, rows, steps = prompt(length, batch=3, seed=6), 4, 4
    model.generate(ids, max_new_tokens=2, **settings)  # (the sampled decode graph compiles on first use)
    counts = []
    for new_tokens in (3, 3 + steps):
        torch.manual_seed(0)
        reference.clear_transfer_counts()
        generated = model.generate(ids, max_new_tokens=new_tokens, eos_token_id=None, **settings)
        counts.append(reference.transfer_counts())
        assert generated.shape[1] == length + new_tokens
    step = {name: (counts[1][name] - counts[0][name]) / steps for name in counts[0]}
    assert step == {"host_to_device_bytes": rows * (8 + 8 + 9 * 4 + 4) + 8, "host_to_device_copies": 5,
                    "device_to_host_bytes": rows * 8, "synchronizations": 1}


def test_sampled_decode_steps_draw_their_tokens_in_the_graph(llama):
    """With Transformers' warpers (temperature, top-k, top-p), the steps draw their tokens in the
    graph: a seed draws the same sequences, another seed others, every token is among the top-k of
    the CPU model's logits, top_k=1 draws the greedy tokens, and the logits never cross to the host."""
    cpu, model = llama
    ids, new_tokens = prompt(5, batch=3, seed=6), 12
    settings = dict(do_sample=True, temperature=0.8, top_k=8, top_p=0.9, eos_token_id=None)
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        runs.append(model.generate(ids, max_new_tokens=new_tokens, **settings))
    assert runs[0].tolist() == runs[1].tolist() != runs[2].tolist()
    for sequences in (runs[0], runs[2]):
        with torch.no_grad():
            top = cpu(sequences).logits[:, 4:-1].topk(8).indices
        assert (top == sequences[:, 5:, None]).any(-1).all()

    greedy = cpu.generate(ids, max_new_tokens=new_tokens, eos_token_id=None, **GREEDY)
    moved = {}
    for name, call_settings in (("sampled", dict(do_sample=True, top_k=1)), ("greedy", GREEDY)):
        reference.clear_transfer_counts()
        generated = model.generate(ids, max_new_tokens=new_tokens, eos_token_id=None, **call_settings)
        moved[name] = reference.transfer_counts()
        assert generated.tolist() == greedy.tolist()
    assert moved["sampled"]["device_to_host_bytes"] == moved["greedy"]["device_to_host_bytes"]


def test_sampling_is_reproducible_under_manual_seed(llama):
    _, model = llama
    ids = prompt(6).to("neuron")
    settings = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3, max_new_tokens=12)
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        runs.append(model.generate(ids, **settings).cpu().tolist())
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_eos_token_lists_and_dict_outputs_match_eager(llama):
    cpu, model = llama
    ids = prompt(6, seed=5)
    free_run = cpu.generate(ids, max_new_tokens=10, **GREEDY)[0, 6:].tolist()
    eos = [free_run[3], 1000 % VOCAB]  # stops at the 4th new token
    settings = dict(max_new_tokens=10, eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True,
                    output_scores=True, **GREEDY)
    expected = cpu.generate(ids, **settings)
    generated = model.generate(ids.to("neuron"), **settings)
    assert generated.sequences.cpu().tolist() == expected.sequences.tolist()
    assert generated.sequences.shape[1] <= 6 + 4
    assert len(generated.scores) == len(expected.scores)
    for device_scores, cpu_scores in zip(generated.scores, expected.scores, strict=True):
        torch.testing.assert_close(device_scores.cpu(), cpu_scores, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A character tokenizer over the tiny vocabulary: every token is one character."""
    characters = string.ascii_letters + string.digits
    characters += "".join(chr(0x100 + index) for index in range(VOCAB - len(characters)))
    backend = Tokenizer(models.BPE({character: index for index, character in enumerate(characters)}, merges=[]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_stop_strings_and_streamer_match_eager(llama, tokenizer, capsys):
    cpu, model = llama
    ids = prompt(7, seed=11)
    free_run = cpu.generate(ids, max_new_tokens=10, **GREEDY)[0, 7:].tolist()
    stop = tokenizer.decode(free_run[3:5])
    settings = dict(max_new_tokens=10, stop_strings=[stop], tokenizer=tokenizer, **GREEDY)
    expected = cpu.generate(ids, streamer=TextStreamer(tokenizer), **settings)
    cpu_text = capsys.readouterr().out
    generated = model.generate(ids.to("neuron"), streamer=TextStreamer(tokenizer), **settings)
    assert generated.cpu().tolist() == expected.tolist()
    assert capsys.readouterr().out == cpu_text
    assert stop in cpu_text


def test_beam_search_falls_back_to_eager_with_one_warning(llama):
    cpu, model = llama
    ids = prompt(5, seed=2)
    settings = dict(num_beams=2, max_new_tokens=5, **GREEDY)
    with pytest.warns(UserWarning, match="beam search .* falling back to Transformers' eager generate"):
        generated = model.generate(ids.to("neuron"), **settings)
    assert generated.cpu().tolist() == cpu.generate(ids, **settings).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.generate(ids.to("neuron"), **settings)  # warned once only


def test_a_call_the_engine_refuses_runs_eagerly_and_compiles_no_second_graph_set(llama):
    """A call of a model the engine serves that the engine refuses (here a right-padded mask) runs
    Transformers' eager generate(), with one warning that says why, rather than compiling the static
    graphs as well: one model, one graph set. Its tokens are Transformers'."""
    cpu, model = llama
    ids, mask = prompt(6, batch=2, seed=4), torch.ones((2, 6), dtype=torch.long)
    mask[1, 4:] = 0
    settings = dict(attention_mask=mask, max_new_tokens=4, **GREEDY)
    generation = model.neuron_generation
    with pytest.warns(UserWarning, match="an attention mask other than left padding does not run on the compiled"):
        generated = model.generate(ids, **settings)
    assert generated.tolist() == cpu.generate(ids, **settings).tolist()
    assert not generation.static.cache_keys and not generation.static._caches
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.generate(ids, **settings)  # warned once only


def test_too_long_generation_falls_back_and_says_how_to_fix(llama):
    _, model = llama
    with pytest.warns(UserWarning, match=r"cache holds 64; raise it with model.precompile\(max_length=...\)"):
        generated = model.generate(prompt(10).to("neuron"), max_new_tokens=60, min_new_tokens=60, **GREEDY)
    assert generated.shape == (1, 70)


def test_auto_class_models_have_compiled_generation_and_it_can_be_removed(tmp_path):
    folder = TINY_MODELS["llama"].save(tmp_path / "llama")
    model = NeuronAutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForCausalLM" and hasattr(model, "precompile")
    assert model.neuron_generation.buckets == Buckets.default(model.config)
    disable_compiled_generation(model)
    assert type(model) is type(TINY_MODELS["llama"].build()) and not hasattr(model, "precompile")


def test_buckets():
    buckets = Buckets((4, 1, 1), (64, 16), 256)
    assert buckets.batch_sizes == (1, 4) and buckets.prompt_buckets == (16, 64)
    assert buckets.batch_size_for(3) == 4 and buckets.batch_size_for(5) is None
    assert buckets.prompt_shape_for(10) == (16, 16)
    assert buckets.prompt_shape_for(64) == (64, 64)
    assert buckets.prompt_shape_for(150) == (192, 64)  # chunked: 3 chunks of the largest bucket
    assert Buckets.from_dict(buckets.to_dict()) == buckets
    with pytest.raises(Exception, match="must be below max_length"):
        Buckets((1,), (64,), 64)


def test_context_buckets_default_to_the_cache_and_its_quarters_and_always_hold_the_cache():
    assert Buckets((1,), (16,), 2048).context_buckets == (128, 512, 2048)
    assert Buckets((1,), (16,), 1000).context_buckets == (250, 1000)
    assert Buckets((1,), (16,), 511).context_buckets == (511,)
    buckets = Buckets((1,), (16,), 96, (48, 24, 24))
    assert buckets.context_buckets == (24, 48, 96)  # sorted, unique, the whole cache added
    assert [buckets.context_bucket_for(length) for length in (1, 24, 25, 48, 49, 96)] == [24, 24, 48, 48, 96, 96]
    assert Buckets.from_dict(buckets.to_dict()) == buckets
    # Saved before context buckets: the default ones.
    assert Buckets.from_dict({"batch_sizes": [1], "prompt_buckets": [16], "max_length": 2048}).context_buckets == (
        128, 512, 2048)
    with pytest.raises(Exception, match="context bucket 128 is above max_length"):
        Buckets((1,), (16,), 96, (24, 128))
    with pytest.raises(Exception, match="context_buckets must hold at least one positive size"):
        Buckets((1,), (16,), 96, (0, 48))


def test_prompt_buckets_have_one_name_and_the_old_one_still_reads_with_a_warning():
    buckets = Buckets((1,), (16, 64), 256)
    assert buckets.to_dict() == {"batch_sizes": [1], "prompt_buckets": [16, 64], "max_length": 256,
                                 "context_buckets": [256]}
    with pytest.warns(FutureWarning, match="Buckets.prompt_lengths is deprecated: use Buckets.prompt_buckets"):
        assert buckets.prompt_lengths == (16, 64)
    saved_before = {"batch_sizes": [1], "prompt_lengths": [64, 16], "max_length": 256}
    with pytest.warns(FutureWarning, match="name their prompt buckets `prompt_lengths`"):
        assert Buckets.from_dict(saved_before) == buckets


def engine_steps(model) -> list[tuple[int, int, int]]:
    """Records (rows, tokens per row, positions attended over) of every step of `model`'s engine."""
    seen, engine = [], model.neuron_generation.engine
    run_step = engine.device.run

    def recording(ids, positions, last, context, *args):
        seen.append((len(ids), len(ids[0]), context))
        return run_step(ids, positions, last, context, *args)

    engine.device.run = recording
    return seen


@pytest.mark.parametrize("name", ["llama", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_each_step_attends_over_the_context_bucket_of_its_length(name, fresh_dynamo):
    """Context buckets 24, 48 and the cache (96): a prompt is prefilled over its bucket, or, longer
    than the largest one, in chunks over the smallest context bucket that holds each; every decode
    step reads the smallest bucket that holds its longest row, from the first token to the cache's
    last slot; tokens equal the CPU's; precompile() compiled every graph those calls meet. Gemma 2's
    sliding-window layers become full layers under a sliding mask, which the buckets narrow too."""
    buckets = Buckets((1, 2), (8, 16), 96, (24, 48))
    cpu, model = compiled(name, buckets, **({"sliding_window": 6} if name == "gemma2" else {}))
    model.precompile(show_progress=False)
    plan = model.neuron_generation.graph_plan()  # the compile bill: the graphs precompile() compiled
    assert describe_plan(plan) == "10 graphs: 2 prefill, 2 chunk, 6 decode"
    assert graphs() == len(plan)
    compiled_graphs, seen = graphs(), engine_steps(model)
    shapes = {(graph.batch, graph.tokens, graph.context) for graph in plan}
    for length, new_tokens, batch in [(5, 91, 1), (40, 20, 1), (33, 40, 2), (20, 4, 2)]:
        ids = prompt(length, batch, seed=length)
        settings = dict(max_new_tokens=new_tokens, eos_token_id=None, **GREEDY)
        assert (model.generate(ids.to("neuron"), **settings).cpu().tolist()
                == cpu.generate(ids, **settings).tolist()), (length, new_tokens)
        assert set(seen) <= shapes
        if batch == 1:
            pieces = [(1, 8, 8)] if length <= 8 else [(1, 16, 16), (1, 16, 48), (1, 16, 48)]
            steps = [(1, 1, buckets.context_bucket_for(length + step)) for step in range(1, new_tokens)]
            assert seen == pieces + steps, (length, seen[:len(pieces) + 2])
        seen.clear()
    assert (graphs(), recompiles()) == (compiled_graphs, 0)


def test_a_cache_filled_exactly_stays_compiled_and_one_past_falls_back(llama):
    """max_length = BUCKETS.max_length = 64: 16 prompt + 48 new tokens fill the static cache to its last
    slot on the compiled graphs; one token more is Transformers' eager generate(), with a warning."""
    cpu, model = llama
    ids = prompt(16, seed=11)
    settings = dict(eos_token_id=None, **GREEDY)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fall-back warning: the graphs serve it
        full = model.generate(ids.to("neuron"), max_new_tokens=48, **settings).cpu()
    assert full.shape == (1, 64)
    assert full.tolist() == cpu.generate(ids, max_new_tokens=48, **settings).tolist()
    with pytest.warns(UserWarning, match="cache holds 64"):
        past = model.generate(ids.to("neuron"), max_new_tokens=49, **settings).cpu()
    assert past.tolist() == cpu.generate(ids, max_new_tokens=49, **settings).tolist()


@pytest.mark.parametrize("name", [pytest.param("llama", marks=pytest.mark.slow), "mistral", *SLOW_ARCHITECTURES])
def test_left_padding_with_and_without_a_mask_matches_eager(name, fresh_dynamo):
    """A left-padded batch (pad id 0, which no prompt uses): with its attention mask, and with none, so
    that generate() infers the mask from the pad tokens; both equal Transformers' eager generate()."""
    cpu, model = compiled(name, Buckets((4,), (16,), 48))
    lengths = (5, 12, 9)
    ids = torch.zeros((3, 12), dtype=torch.long)
    mask = torch.zeros((3, 12), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, 12 - length:], mask[row, 12 - length:] = prompt(length, seed=20 + row)[0], 1
    settings = dict(max_new_tokens=8, min_new_tokens=8, pad_token_id=0, **GREEDY)
    with_mask = cpu.generate(ids, attention_mask=mask, **settings)
    without_mask = cpu.generate(ids, **settings)
    assert with_mask.tolist() == without_mask.tolist()  # the inferred mask is the same mask
    assert (model.generate(ids.to("neuron"), attention_mask=mask.to("neuron"), **settings).cpu().tolist()
            == with_mask.tolist())
    assert model.generate(ids.to("neuron"), **settings).cpu().tolist() == without_mask.tolist()


def noisy_model(config) -> torch.nn.Module:
    """A model of `config` on the CPU with noise on every weight (initialization leaves position
    embeddings near zero, and norms at one, which would hide a shifted position)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=torch.Generator().manual_seed(0)))
    return model


@pytest.mark.slow
def test_a_decoder_numbering_positions_by_cache_slot_keeps_its_prompt_length(fresh_dynamo):
    """MBart's decoder (no position_ids: learned positions from the cache length) would see its
    positions shifted by left padding: its prompts are not padded, a prefill graph per length."""
    config = MBartConfig(vocab_size=VOCAB, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                         encoder_attention_heads=4, decoder_ffn_dim=64, max_position_embeddings=64, is_decoder=True,
                         is_encoder_decoder=False)
    cpu = noisy_model(config)
    model = enable_compiled_generation(copy.deepcopy(cpu).to("neuron"), BUCKETS)
    settings = dict(max_new_tokens=6, min_new_tokens=6, **GREEDY)
    with pytest.warns(UserWarning, match="'mbart' numbers positions by cache slot") as caught:
        for length in (5, 11, 5):
            ids = prompt(length, seed=length)
            assert model.generate(ids.to("neuron"), **settings).cpu().tolist() == \
                cpu.generate(ids, **settings).tolist()
    assert len([w for w in caught if "numbers positions" in str(w.message)]) == 1
    assert not [w for w in caught if "does not run on the compiled" in str(w.message)]
    assert graphs() == 3  # prefill 5, prefill 11, decode


def falcon_config_saying_two_key_value_heads() -> FalconConfig:
    """A multi-query Falcon (one key/value head written) whose config says 2 key/value heads, as a saved
    config may (the benchmarks/coverage.py sweep's does): what Transformers reads from it is wrong."""
    config = FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_kv_heads=2, multi_query=True, new_decoder_architecture=False)
    config.num_key_value_heads = 2
    return config


@pytest.mark.parametrize("config", [
    pytest.param(GPTBigCodeConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True),
                 id="gpt_bigcode"),
    pytest.param(falcon_config_saying_two_key_value_heads(), id="falcon", marks=pytest.mark.slow),
    # Sliding layers with twice the key/value heads of the config's.
    pytest.param(MiMoV2FlashConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, v_head_dim=8,
                                   layer_types=["full_attention", "sliding_attention"],
                                   mlp_layer_types=["dense", "dense"], sliding_window=16, max_position_embeddings=64),
                 id="mimo_v2_flash", marks=pytest.mark.slow),
])
def test_key_value_heads_the_config_does_not_give_generate_compiled(config, fresh_dynamo):
    """Key/value heads other than the attention heads (one for multi-query attention) or than the
    config's (one in that Falcon, twice as many in MiMo's sliding layers): the engine's slots take
    them from the keys and values of one eager step where the config's cannot be checked against the
    model's projections."""
    cpu = noisy_model(config)
    model = enable_compiled_generation(copy.deepcopy(cpu).to("neuron"), BUCKETS)
    ids, settings = prompt(7), dict(max_new_tokens=6, min_new_tokens=6, **GREEDY)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fall-back to eager generation
        assert model.generate(ids.to("neuron"), **settings).cpu().tolist() == cpu.generate(ids, **settings).tolist()
    generation = model.neuron_generation
    assert generation.static.unservable is None and generation.engine_gap is None and generation.engine.steps == 5


@pytest.mark.slow
def test_a_decoder_sizing_positions_by_the_cache_length_reads_it_as_a_scalar(fresh_dynamo):
    """TrOCR computes positions as arange(length, length + n) from the cache's length, a tensor in a
    static cache: a data-dependent size. The first compiled call finds it and generation retries
    with the length read as a scalar (n is then static): same tokens, no warning, no graph per step."""
    config = TrOCRConfig(vocab_size=VOCAB, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                         decoder_ffn_dim=64, max_position_embeddings=64)
    cpu = noisy_model(config)
    model = enable_compiled_generation(copy.deepcopy(cpu).to("neuron"), BUCKETS)
    ids, settings = prompt(7), dict(max_new_tokens=6, min_new_tokens=6, **GREEDY)
    streamer = RecordingStreamer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generated = model.generate(ids.to("neuron"), streamer=streamer, **settings)
    assert generated.cpu().tolist() == cpu.generate(ids, **settings).tolist()
    assert not [w for w in caught if "does not run on the compiled" in str(w.message)]
    assert model.neuron_generation.static.cache_length_as_scalar and model.neuron_generation.static.unservable is None
    assert streamer.puts[0] == ids[0].tolist() and len(streamer.puts) == 1 + 6  # the prompt once, then each token
    assert recompiles() == 0 and len(model.neuron_generation.cache_keys) >= 2


class RecordingStreamer(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[list[int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


@pytest.mark.slow
def test_a_model_reading_the_cache_length_before_its_update_matches_eager(fresh_dynamo):
    """Inkling reads `get_query_offset()` before updating the cache and uses it after: a static
    layer's length tensor, incremented in place by the update, must not reach it (positions off by
    the step's length, silently other tokens)."""
    torch.manual_seed(0)
    config = InklingTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4,
                               swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=128, rel_extent=128,
                               moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                               layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "sparse"],
                               max_position_embeddings=64, experts_implementation="eager")
    cpu = AutoModelForCausalLM.from_config(config).eval()
    for name, parameter in cpu.named_parameters():
        if name.endswith("rel_logits_proj.proj"):  # (initialized to zeros: no position would show)
            torch.nn.init.normal_(parameter)
    device_model = copy.deepcopy(cpu).to("neuron")
    assert apply_patches(device_model) == ["static_moe_experts", "sorted_topk"]  # (as from_pretrained does)
    model = enable_compiled_generation(device_model, BUCKETS)
    settings = dict(max_new_tokens=8, output_scores=True, return_dict_in_generate=True, **GREEDY)
    for length in (6, 16):
        ids = prompt(length, seed=length)
        expected, generated = cpu.generate(ids, **settings), model.generate(ids.to("neuron"), **settings)
        torch.testing.assert_close(torch.stack(generated.scores).cpu(), torch.stack(expected.scores))
        assert generated.sequences.cpu().tolist() == expected.sequences.tolist()
    assert model.neuron_generation.static.unservable is None and recompiles() == 0


@pytest.mark.slow
def test_a_state_space_model_generates_compiled_and_a_prompt_past_one_chunk_eagerly(fresh_dynamo):
    """Mamba's cache holds states only: Transformers' chunked prefill cannot ask its length, and its
    scan starts from a zero state on each chunk, so a prompt is prefilled in one chunk or not compiled."""
    torch.manual_seed(0)
    config = MambaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, state_size=8)
    cpu = AutoModelForCausalLM.from_config(config).eval()
    model = enable_compiled_generation(copy.deepcopy(cpu).to("neuron"), BUCKETS)
    assert model.neuron_generation.static.states_only
    settings = dict(max_new_tokens=6, **GREEDY)
    for length in (6, 6, 16):  # (unpadded prompts: forward takes no position_ids)
        ids = prompt(length, seed=length)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # (the unpadded-prompts note)
            generated = model.generate(ids.to("neuron"), **settings)
        assert generated.cpu().tolist() == cpu.generate(ids, **settings).tolist()
    assert model.neuron_generation.static.unservable is None and recompiles() == 0
    # 2 prefill lengths, a decode step: their programs, and their compiled functions (saved for warm starts)
    assert len(model.neuron_generation.cache_keys) == 3 * (PROGRAMS_PER_GRAPH + 1)

    ids = prompt(17)  # one past the largest prompt bucket: two chunks
    with pytest.warns(UserWarning, match="a prompt of 17 tokens, above the largest prompt bucket \\(16\\), in a model "
                                         "whose cache holds state-space states only"):
        generated = model.generate(ids.to("neuron"), **settings)
    assert generated.cpu().tolist() == cpu.generate(ids, **settings).tolist()
    assert model.neuron_generation.static.unservable is None  # this call only


@pytest.mark.parametrize("config, reason", [
    # Data-dependent branching in forward (Dynamo cannot trace it in one graph).
    (CpmAntConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, dim_head=8, dim_ff=64,
                  num_hidden_layers=2), "its compiled forward fails with "),
    # A recurrent model keeping its own state (no `cache` argument), known before any compile.
    (RwkvConfig(vocab_size=VOCAB, hidden_size=32, attention_hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, context_length=64), "its forward takes no `cache`"),
], ids=["data-dependent-branch", "own-recurrent-state"])
def test_a_model_the_graphs_cannot_serve_generates_eagerly_with_one_warning(config, reason, fresh_dynamo):
    torch.manual_seed(0)
    cpu = AutoModelForCausalLM.from_config(config).eval()
    model = enable_compiled_generation(copy.deepcopy(cpu).to("neuron"), BUCKETS)
    ids, settings = prompt(6), dict(max_new_tokens=5, min_new_tokens=5, **GREEDY)
    expected = cpu.generate(ids, **settings)
    streamer = RecordingStreamer()
    warning = rf"model type '{config.model_type}' \({reason}.*What would make it compile: "
    with pytest.warns(UserWarning, match=warning):
        generated = model.generate(ids.to("neuron"), streamer=streamer, **settings)
    assert generated.cpu().tolist() == expected.tolist()
    assert streamer.puts[0] == ids[0].tolist() and len(streamer.puts) == 1 + 5  # the prompt once, then each token
    assert model.neuron_generation.static._caches == {}  # the static caches are released
    assert model.neuron_generation.static.unservable[0].startswith(f"model type '{config.model_type}'")  # remembered
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # warned once only; eager from now on, no compile tried
        frames = torch._dynamo.utils.counters["frames"]["total"]
        assert model.generate(ids.to("neuron"), **settings).cpu().tolist() == expected.tolist()
        assert torch._dynamo.utils.counters["frames"]["total"] == frames


def test_a_bad_input_raises_its_own_error_and_the_model_still_generates_compiled(llama):
    cpu, model = llama
    too_large = torch.full((1, 4), VOCAB + 7)
    with warnings.catch_warnings():
        # no "does not run on the compiled graphs" warning (others, e.g. about warm starts, may come:
        # this test runs after models of new classes, whose outputs Dynamo's guards count)
        warnings.filterwarnings("error", message="generate\\(\\) with", category=UserWarning)
        with pytest.raises(IndexError, match=f"input_ids holds the token id {VOCAB + 7}, outside the model's "
                                             f"vocabulary of {VOCAB}"):
            model.generate(too_large.to("neuron"), max_new_tokens=2, **GREEDY)
        assert model.neuron_generation.static.unservable is None and model.neuron_generation.engine_gap is None
        ids = prompt(5)
        assert model.generate(ids.to("neuron"), max_new_tokens=3, **GREEDY).cpu().tolist() == \
            cpu.generate(ids, max_new_tokens=3, **GREEDY).tolist()
