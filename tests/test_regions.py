"""One compile per distinct layer: a model's repeated layers traced as nested compile regions are
compiled once each (per input shapes), the rest of the graph in pieces, with the logits and cache
writes of Transformers on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import StaticCache

from optimum_neuron_torch.compiler import cache_stats, partition, regions
from optimum_neuron_torch.settings import COMPILE_CACHE_ENV
from tiny_models import TINY_MODELS


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(tmp_path))
    torch._dynamo.reset()
    yield tmp_path
    torch._dynamo.reset()


def prefill_and_decode(model, backend=None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The logits of an 8-token prefill and a decode step on a static cache (compiled with `backend`
    if given), and the cache's keys afterwards; on the CPU."""
    device = model.device
    ids = torch.randint(4, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    cache = StaticCache(config=model.config, max_cache_len=16)
    forward = torch.compile(model, backend=backend, fullgraph=True, dynamic=False) if backend else model
    logits = []
    with torch.no_grad():
        for step_ids, position in ((ids, torch.arange(8)), (ids[:, -1:] + 1, torch.tensor([8]))):
            out = forward(input_ids=step_ids.to(device), cache=cache, cache_position=position.to(device))
            logits.append(out.logits.cpu())
    return logits, [layer.keys.cpu() for layer in cache.layers]


class CountingBackend:
    """`regions.backend`, noting the ops of every graph it hands on (when it does: the split around
    nodes the compiler cannot take, `partition.compile_or_split`, rewrites a graph in place)."""

    def __init__(self) -> None:
        self.graphs: list[list[str]] = []

    def __call__(self, gm, example_inputs):
        device_backend = torch._dynamo.lookup_backend("neuron")

        def compile_graph(graph, inputs):
            self.graphs.append([str(node.target) for node in graph.graph.nodes])
            return partition.compile_or_split(graph, inputs, device_backend)

        return regions.compile_regions(gm, example_inputs, compile_graph)

    @staticmethod
    def ops(graph: list[str], name: str) -> int:
        return sum(1 for target in graph if name in target)


def test_the_repeated_decoder_layers_compile_once_per_shape_with_the_cpu_logits(fresh_cache):
    tiny = TINY_MODELS["llama"]
    cpu_logits, cpu_keys = prefill_and_decode(tiny.build().eval())
    model = tiny.build().eval().to("neuron")
    backend, before = CountingBackend(), cache_stats()
    with regions.repeated_layers_as_regions(model) as layers:
        assert layers == list(model.model.layers) and len(layers) == model.config.num_hidden_layers == 2
        logits, keys = prefill_and_decode(model, backend)
    for got, expected in zip([*logits, *keys], [*cpu_logits, *cpu_keys], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Per shape (the prefill, the decode step): the part before the layers, one layer, the part after.
    assert len(backend.graphs) == 6 and cache_stats().misses == before.misses + 6
    layer_graphs = [graph for graph in backend.graphs if backend.ops(graph, "index_copy_")]
    assert len(layer_graphs) == 2  # one layer per shape, its keys and values written into its own cache
    for graph in layer_graphs:
        assert backend.ops(graph, "index_copy_") == 2 and backend.ops(graph, "linear") == 7  # q k v o, the MLP
    assert not any(backend.ops(graph, "invoke_subgraph") for graph in backend.graphs)  # the device never sees one
    assert "forward" not in vars(model.model.layers[0])  # the marks went with the block


def test_a_model_without_regions_compiles_whole(fresh_cache):
    model = TINY_MODELS["llama"].build().eval().to("neuron")
    backend = CountingBackend()
    prefill_and_decode(model, backend)
    assert len(backend.graphs) == 2 and backend.ops(backend.graphs[0], "index_copy_") == 4  # both layers inline


@pytest.mark.slow  # (another architecture of the same path)
def test_layers_whose_code_differs_are_distinct_regions(fresh_cache):
    """Gemma2 alternates sliding-window and full-attention layers: traced differently, each kind is
    its own region; every layer still writes its own cache."""
    tiny = TINY_MODELS["gemma2"]
    cpu_logits, cpu_keys = prefill_and_decode(tiny.build().eval())
    model = tiny.build().eval().to("neuron")
    backend = CountingBackend()
    with regions.repeated_layers_as_regions(model):
        logits, keys = prefill_and_decode(model, backend)
    for got, expected in zip([*logits, *keys], [*cpu_logits, *cpu_keys], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert all(key.abs().sum() > 0 for key in keys)


def test_the_device_backend_given_a_region_refuses_it_naming_it(fresh_cache):
    """As TorchNeuron's backend fails on `invoke_subgraph` (its FxImporter has none), the reference
    device's backend refuses a graph holding one (and `regions.backend` never hands it one)."""
    model = TINY_MODELS["llama"].build().eval().to("neuron")
    refused = r"node invoke_subgraph .*nested compile region \(TorchNeuron's FxImporter has no invoke_subgraph"
    with regions.repeated_layers_as_regions(model), pytest.raises(torch._dynamo.exc.BackendCompilerFailed,
                                                                  match=refused):
        prefill_and_decode(model, "neuron")


def encode(encoder: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return encoder(input_ids=input_ids).last_hidden_state


@pytest.mark.slow  # (37 s; the fast tier meets the same fall-back in test_pipelines' T5 text2text generation)
def test_layers_dynamo_cannot_trace_as_regions_compile_whole_with_one_warning(fresh_cache):
    """T5's layers hand their position bias on, which `invoke_subgraph` does not capture: the graphs
    compile whole, once, with one warning naming why; the output is the CPU's."""
    tiny = TINY_MODELS["t5"]
    cpu, model = tiny.build().eval(), tiny.build().eval().to("neuron")
    step = regions.compile_by_layer(encode, backend="neuron", fullgraph=True, dynamic=False)
    ids = torch.randint(4, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with pytest.warns(UserWarning, match="repeated layers could not be compiled once each .*Error: "):
            hidden = step(model.get_encoder(), ids.to("neuron"))
        torch.testing.assert_close(hidden.cpu(), encode(cpu.get_encoder(), ids), rtol=1e-5, atol=1e-5)
        assert step.whole_graph_reason is not None
        before = cache_stats()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # (no second warning, no second attempt at regions)
            torch.testing.assert_close(step(model.get_encoder(), ids[:1].to("neuron")).cpu(),
                                       encode(cpu.get_encoder(), ids[:1]), rtol=1e-5, atol=1e-5)
        assert cache_stats().misses == before.misses + 1  # the new shape, whole
    with pytest.raises(ValueError, match="not 'inductor'"):
        regions.compile_by_layer(encode, backend="inductor")
