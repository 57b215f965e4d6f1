"""The compile bill: which graphs compiled generation and the engine compile for a set of buckets,
and how many programs the compiler gets from them (optimum_neuron_torch.generation.buckets), checked
graph by graph on small bucket sets worked out by hand. Pure functions, in process: the mutation
campaign (benchmarks/mutation.py) runs these. End to end, tests/test_generation.py and
tests/test_check.py compare the plans with the graphs that actually compile."""

from __future__ import annotations

import warnings

import pytest
import transformers

from optimum_neuron_torch.generation.buckets import (
    Buckets,
    PlannedGraph,
    chunk_contexts,
    compile_bill,
    describe_plan,
    distinct_programs,
    engine_plan,
    graph_plan,
)


def graphs(*specs: tuple[str, int, int, int]) -> list[PlannedGraph]:
    return [PlannedGraph(*spec) for spec in specs]


ONE_CONTEXT = Buckets((1, 4), (8, 16), 64)  # context buckets (64,): no windows, no chunk graphs
WINDOWS = Buckets((2,), (8, 16), 64, (16, 32))  # context buckets (16, 32, 64)


def test_one_context_bucket_plans_prefills_and_a_decode_step_per_batch_bucket():
    assert graph_plan(ONE_CONTEXT) == graphs(("prefill", 1, 8, 64), ("prefill", 1, 16, 64), ("decode", 1, 1, 64),
                                             ("prefill", 4, 8, 64), ("prefill", 4, 16, 64), ("decode", 4, 1, 64))
    assert graph_plan(ONE_CONTEXT, sampling=True)[2:4] == graphs(("decode", 1, 1, 64), ("sampling decode", 1, 1, 64))
    assert len(graph_plan(ONE_CONTEXT, sampling=True)) == 8


def test_context_buckets_plan_prefills_in_their_bucket_decode_steps_and_chunks_per_context():
    assert graph_plan(WINDOWS) == graphs(
        ("prefill", 2, 8, 16), ("prefill", 2, 16, 16),
        ("decode", 2, 1, 16), ("decode", 2, 1, 32), ("decode", 2, 1, 64),
        ("chunk", 2, 16, 32), ("chunk", 2, 16, 64))  # a chunk after the first ends at 32 or later
    assert graph_plan(WINDOWS, chunks=False) == graph_plan(WINDOWS)[:5]  # (state-space caches: prefilled whole)
    assert graph_plan(WINDOWS, sampling=True)[7:] == graphs(
        ("sampling decode", 2, 1, 16), ("sampling decode", 2, 1, 32), ("sampling decode", 2, 1, 64))


@pytest.mark.parametrize("max_length, chunked", [(33, False), (34, True)])
def test_chunks_are_planned_when_a_prompt_of_two_chunks_and_a_new_token_fits(max_length, chunked):
    # 2 chunks of 16 and 2 more positions (the first new token and the one it predicts) must fit
    plan = graph_plan(Buckets((1,), (16,), max_length, (17,)))
    assert [graph.role for graph in plan] == ["prefill", "decode", "decode"] + ["chunk"] * chunked
    if chunked:
        assert plan[-1] == PlannedGraph("chunk", 1, 16, max_length)


def test_a_chunk_of_the_shapes_of_a_prefill_is_that_prefill():
    plan = graph_plan(Buckets((1,), (16,), 128, (64,)))  # the chunk in context 64 is the prefill of 16 tokens
    assert plan == graphs(("prefill", 1, 16, 64), ("decode", 1, 1, 64), ("decode", 1, 1, 128),
                          ("chunk", 1, 16, 128))


def test_encoder_decoders_plan_an_encoder_and_a_decode_step_per_prompt_bucket():
    assert graph_plan(Buckets((1, 2), (8, 16), 64, (16, 32)), encoder_decoder=True, sampling=True) == graphs(
        ("encoder", 1, 8, 0), ("decode", 1, 1, 8), ("encoder", 1, 16, 0), ("decode", 1, 1, 16),
        ("encoder", 2, 8, 0), ("decode", 2, 1, 8), ("encoder", 2, 16, 0), ("decode", 2, 1, 16))


@pytest.mark.parametrize("buckets, expected", [
    (Buckets((1,), (16,), 17), ()),  # the longest prompt (16 tokens) is one chunk
    (Buckets((1,), (16,), 18), (18,)),  # a second chunk ends at max_length, before 2 chunks
    (Buckets((1,), (16,), 64, (16, 32)), (32, 64)),
    (Buckets((1,), (16,), 256, (32, 48, 64, 128)), (32, 48, 64, 128, 256)),
    (Buckets((1,), (8, 16), 256, (24, 40, 128)), (40, 128, 256)),
])
def test_chunk_contexts_start_at_the_bucket_of_two_chunks(buckets, expected):
    assert chunk_contexts(buckets) == expected


def test_the_engine_plans_one_row_prefills_its_chunks_and_two_steps_per_batch_and_context():
    buckets = Buckets((1, 2), (8, 16), 64, (32, 64))
    expected = graphs(("prefill", 1, 8, 8), ("prefill", 1, 16, 16), ("chunk", 1, 16, 32), ("chunk", 1, 16, 64),
                      ("decode", 1, 1, 32), ("sampling decode", 1, 1, 32),
                      ("decode", 1, 1, 64), ("sampling decode", 1, 1, 64),
                      ("decode", 2, 1, 32), ("sampling decode", 2, 1, 32),
                      ("decode", 2, 1, 64), ("sampling decode", 2, 1, 64))
    assert engine_plan(buckets) == expected
    assert engine_plan(buckets, sampling=False) == [graph for graph in expected if graph.role != "sampling decode"]
    assert describe_plan(expected) == "12 graphs: 2 prefill, 2 chunk, 4 decode, 4 sampling decode"
    assert describe_plan([]) == "0 graphs: "


def test_distinct_programs_count_shared_code_once():
    engine = engine_plan(Buckets((1, 2), (8, 16), 64, (32, 64)))
    # 8 shapes (a program before the layers and one per layer kind each) and 6 ends (rows, tokens, sampling)
    assert distinct_programs(engine, engine=True) == 8 * 2 + 6
    assert distinct_programs(engine, 2, engine=True) == 8 * 3 + 6
    # 5 befores (a decode step's per context), 7 layer programs, 3 ends
    assert distinct_programs(graph_plan(WINDOWS)) == 5 + 7 + 3
    assert distinct_programs(graph_plan(WINDOWS), 2) == 5 + 14 + 3
    # a step that samples shares all but its end with the greedy one
    assert distinct_programs(graph_plan(Buckets((1,), (8, 16), 64), sampling=True)) == 3 + 3 + 4
    # an encoder has its own programs: 4 befores, 4 layer programs, 3 ends
    assert distinct_programs(graph_plan(Buckets((1,), (8, 16), 64), encoder_decoder=True)) == 4 + 4 + 3


def test_the_compile_bill_names_buckets_graphs_and_programs():
    plan = graph_plan(ONE_CONTEXT)
    head = ["buckets: batch sizes [1, 4], prompt buckets [8, 16], max length 64, context buckets [64]",
            "graphs to compile: 6 graphs: 4 prefill, 2 decode"]
    assert compile_bill(ONE_CONTEXT, plan, None) == head
    assert compile_bill(ONE_CONTEXT, plan, 0) == head
    assert compile_bill(ONE_CONTEXT, plan, 3) == [*head, (
        "distinct programs after layer reuse: 18 (each graph: the code before its 3 decoder layers, 1 layer program "
        "called for all of them, the code after; graphs of the same shapes share them)")]
    assert compile_bill(ONE_CONTEXT, plan, 3, layer_kinds=2)[2].startswith(
        "distinct programs after layer reuse: 24 (each graph: the code before its 3 decoder layers, 2 layer programs "
        "called")
    assert compile_bill(ONE_CONTEXT, plan, 3, layer_reuse=False) == [*head, (
        "distinct programs: 6 (each graph holds all 3 decoder layers inline: layer reuse is off)")]
    engine = engine_plan(ONE_CONTEXT)
    assert compile_bill(ONE_CONTEXT, engine, 3, engine=True)[2].startswith(
        f"distinct programs after layer reuse: {distinct_programs(engine, engine=True)} ")
    assert distinct_programs(engine, engine=True) != distinct_programs(engine)


@pytest.mark.parametrize("slots, batch_sizes", [(1, (1,)), (2, (1, 2)), (5, (1, 2, 4, 5)), (8, (1, 2, 4, 8))])
def test_an_engine_of_n_slots_has_the_powers_of_two_below_n_and_n_as_batch_buckets(slots, batch_sizes):
    config = transformers.LlamaConfig(max_position_embeddings=4096)
    buckets = Buckets.for_slots(config, slots, 128, (16, 48))
    assert buckets == Buckets(batch_sizes, (16, 48), 128)
    default = Buckets.for_slots(config, slots)  # the model's buckets otherwise
    assert default == Buckets(batch_sizes, Buckets.default(config).prompt_buckets, 2048)
    assert default.context_buckets == (128, 512, 2048)
    assert default.context_bucket_for(2049) == 2048  # (beyond the cache: its whole length)


def test_an_encoder_and_a_decoder_graph_of_the_same_shapes_are_different_programs():
    plan = graphs(("encoder", 1, 16, 0), ("prefill", 1, 16, 0))  # (the encoder's code is not the decoder's)
    assert distinct_programs(plan) == 2 + 2 + 2
    assert distinct_programs(plan, 3) == 2 + 6 + 2


def test_chunks_attend_over_the_bucket_of_two_chunks_or_larger_only():
    plan = graph_plan(Buckets((1,), (16,), 64, (8, 16, 24, 32)))  # a chunk never attends over 8, 16 or 24
    assert [graph for graph in plan if graph.role == "chunk"] == graphs(("chunk", 1, 16, 32), ("chunk", 1, 16, 64))


def test_the_bill_of_static_graphs_counts_their_programs_as_static_graphs_share_them():
    plan = graph_plan(WINDOWS)  # (the engine's count of the same plan differs: 17)
    assert compile_bill(WINDOWS, plan, 2)[2].startswith("distinct programs after layer reuse: 15 (")
    assert distinct_programs(plan, engine=True) == 17


def test_saved_buckets_read_their_prompt_buckets_by_either_name_the_current_one_first():
    saved = {"batch_sizes": [1], "prompt_buckets": [16], "prompt_lengths": [32], "max_length": 64}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the current name: no warning)
        assert Buckets.from_dict(saved).prompt_buckets == (16,)
    del saved["prompt_buckets"]
    with pytest.warns(FutureWarning) as caught:
        assert Buckets.from_dict(saved).prompt_buckets == (32,)
    assert [str(warning.message) for warning in caught] == [
        "these saved buckets name their prompt buckets `prompt_lengths`, as development versions before 0.1.0.dev0 "
        "did: read as `prompt_buckets` (save the model again to update the file)."]


def test_a_context_bucket_above_the_cache_is_named():
    with pytest.raises(Exception) as caught:
        Buckets((1,), (16,), 96, (24, 48, 128))
    assert str(caught.value) == ("context bucket 128 is above max_length (96), the length of the KV cache they are "
                                 "parts of.")
