"""Compiled graphs that survive: a graph holding nodes TorchNeuron's compiler cannot take is refused
by the device's `neuron` backend, as TorchNeuron's refuses it, and split by the library's own
(`regions.backend`): its supported parts compiled (each a cached graph with its StableHLO), the rest
run eagerly."""

from __future__ import annotations

import re

import pytest
import torch

import optimum_neuron_torch
from optimum_neuron_torch.compiler import (
    CompileCache,
    FallbackNode,
    cache_stats,
    partition,
    recording_partitions,
    regions,
)
from optimum_neuron_torch.compiler.artifact import STABLEHLO_FILE
from optimum_neuron_torch.compiler.partition import unsupported_by_construction
from optimum_neuron_torch.errors import UnsupportedGraphError
from optimum_neuron_torch.settings import COMPILE_CACHE_ENV as CACHE_ENV
from optimum_neuron_torch.settings import DISABLE_GRAPH_SPLIT_ENV as DISABLE_SPLIT_ENV
from testing_utils import run_python

ZETA = FallbackNode("special_zeta", "torch._C._special.special_zeta",
                    "no StableHLO lowering for aten.special_zeta.other_scalar")


class ZetaBetweenLinears(torch.nn.Module):
    """linear -> zeta (which Torch-MLIR cannot lower) -> linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.special.zeta(self.first(x).abs() + 1.5, 2.0))


class ComplexRotation(torch.nn.Module):
    """linear -> complex rotation (RoPE's complex form) -> linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.register_buffer("rotation", torch.polar(torch.ones(2, 4), torch.randn(2, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rotated = torch.view_as_complex(self.first(x).reshape(2, 4, 2)) * self.rotation
        return self.second(torch.view_as_real(rotated).flatten(1))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    torch._dynamo.reset()
    return CompileCache(tmp_path)


def test_an_op_that_does_not_lower_splits_the_graph_into_two_compiled_pieces(cache):
    model = ZetaBetweenLinears()
    compiled = torch.compile(model.to("neuron"), backend=regions.backend, fullgraph=True, dynamic=False)
    x = torch.randn(2, 8)
    optimum_neuron_torch.clear_op_tracking()
    with recording_partitions() as reports, torch.no_grad():
        with pytest.warns(UserWarning, match=r"graph split into 2 compiled pieces around 1 op TorchNeuron's compiler "
                                             r"cannot take: torch\._C\._special\.special_zeta "
                                             r"\(no StableHLO lowering"):
            first = compiled(x.to("neuron"))
        graphs, misses = torch._dynamo.utils.counters["stats"]["unique_graphs"], cache_stats().misses
        y = torch.randn(2, 8)
        second = compiled(y.to("neuron"))
    assert [(report.compiled_pieces, report.fallback_nodes) for report in reports] == [(2, [ZETA])]
    assert "aten::special_zeta.out" in optimum_neuron_torch.fallback_ops()  # ran eagerly, on the counted fallback path
    with torch.no_grad():
        model.cpu()
        torch.testing.assert_close(first.cpu(), model(x))
        torch.testing.assert_close(second.cpu(), model(y))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs and cache_stats().misses == misses
    entries = list(cache.entries())
    assert len(entries) == 2  # the two pieces, each cached with its StableHLO; the whole graph was never compiled
    for entry in entries:
        assert (entry.metadata["stablehlo"] == "ok"
                and "stablehlo.dot_general" in (entry.path / STABLEHLO_FILE).read_text())


def test_the_device_backend_refuses_such_a_graph_as_torchneuron_s_does_naming_the_nodes(cache):
    """TorchNeuron's backend compiles a graph whole or fails: so does the reference device's, naming the
    nodes and the backend that splits around them, and compiling nothing."""
    for model, named in [(ZetaBetweenLinears(), r"node special_zeta \(torch\._C\._special\.special_zeta\): no "
                                                r"StableHLO lowering for aten\.special_zeta\.other_scalar"),
                         (ComplexRotation(), r"node view_as_complex \(torch\.view_as_complex\): complex dtype")]:
        torch._dynamo.reset()
        compiled = torch.compile(model.to("neuron"), backend="neuron", fullgraph=True, dynamic=False)
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as raised, torch.no_grad():
            compiled(torch.randn(2, 8, device="neuron"))
        error = raised.value.inner_exception
        assert isinstance(error, UnsupportedGraphError) and isinstance(error, RuntimeError)
        assert re.search(named, str(error)) and "optimum_neuron_torch.compiler.regions.backend" in str(error)
    assert list(cache.entries()) == []


def test_a_graph_the_compiler_takes_whole_is_not_split(cache):
    compiled = torch.compile(lambda x, w: torch.relu(x @ w).pow(2), backend="neuron", fullgraph=True, dynamic=False)
    x, w = torch.randn(2, 8), torch.randn(8, 4)
    with recording_partitions() as reports:
        result = compiled(x.to("neuron"), w.to("neuron"))
    torch.testing.assert_close(result.cpu(), torch.relu(x @ w).pow(2))
    assert reports == [] and len(list(cache.entries())) == 1


def test_disabled_splitting_raises_naming_the_op(cache, monkeypatch):
    monkeypatch.setenv(DISABLE_SPLIT_ENV, "1")
    compiled = torch.compile(ZetaBetweenLinears().to("neuron"), backend=regions.backend, fullgraph=True, dynamic=False)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as raised:
        compiled(torch.randn(2, 8, device="neuron"))
    assert isinstance(raised.value.inner_exception, UnsupportedGraphError)
    assert re.search(r"node special_zeta \(torch\._C\._special\.special_zeta\): no StableHLO lowering for "
                     rf"aten\.special_zeta\.other_scalar.*unset {DISABLE_SPLIT_ENV}",
                     str(raised.value.inner_exception))
    assert list(cache.entries()) == []  # refused before anything was compiled


def test_complex_nodes_are_split_out_and_run_eagerly(cache):
    model = ComplexRotation()
    compiled = torch.compile(model.to("neuron"), backend=regions.backend, fullgraph=True, dynamic=False)
    x = torch.randn(2, 8)
    with recording_partitions() as reports, torch.no_grad(), pytest.warns(UserWarning, match="complex dtype"):
        result = compiled(x.to("neuron"))
    (report,) = reports
    assert report.compiled_pieces == 2 and len(list(cache.entries())) == 2
    assert [(node.op, node.reason) for node in report.fallback_nodes] == [
        ("torch.view_as_complex", "complex dtype"), ("_operator.mul", "complex dtype"),
        ("torch.view_as_real", "complex dtype"),
    ]
    with torch.no_grad():
        torch.testing.assert_close(result.cpu(), model.cpu()(x))


def _graph_of(function, *inputs) -> torch.fx.GraphModule:
    graphs = []
    torch._dynamo.reset()
    torch.compile(function, backend=lambda gm, _: graphs.append(gm) or gm, fullgraph=True)(*inputs)
    return graphs[0]


def test_data_dependent_shapes_and_float64_are_unsupported_by_construction():
    x = torch.randn(3, 4, device="neuron")
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        graph = _graph_of(lambda x: torch.nonzero(x > 0).sum() + x.sum(), x)
    reasons = {node.name: reason for node, reason in unsupported_by_construction(graph).items()}
    assert reasons["nonzero"] == "data-dependent output shape" and reasons["sum_1"] == "input of data-dependent shape"
    assert "gt" not in reasons and "sum_2" not in reasons
    graph = _graph_of(lambda x: (x.double() * 2).float() + 1, x)
    reasons = {node.name: reason for node, reason in unsupported_by_construction(graph).items()}
    assert reasons == {"double": "float64 dtype", "mul": "float64 dtype", "float_1": "float64 dtype"}


SHARED_ITEM_PROGRAM = """
import resource, torch
resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))  # without the check, memory grows without end
import optimum_neuron_torch
from optimum_neuron_torch.compiler import regions

class IndexedByRouting(torch.nn.Module):
    # Experts' weights indexed by a routing decision (MoE routers do it), and an op that does not lower.
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.router, self.weights = torch.nn.Linear(8, 4), torch.nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x):
        chosen = self.weights[self.router(x).argmax(-1)]
        return torch.einsum("bi,bio->bo", torch.special.zeta(x.abs() + 1.5, 2.0), chosen)

model, x = IndexedByRouting(), torch.randn(2, 8)
expected = model(x)
got = torch.compile(model.to("neuron"), backend=regions.backend, fullgraph=True, dynamic=False)(x.to("neuron"))
torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
print("same as the CPU")
"""


def test_a_tensor_indexed_by_a_tensor_splits_with_the_cpu_output(tmp_path):
    """A tensor indexed by a tensor, each used for indexing only (`weights[expert_ids]`; the server's
    `hidden[:, last]`): as an `operator.getitem`, torch.fx's partitioner takes it for an item of
    both and moves it back and forth without end (the memory limit ends that); it is split as the
    op it is, and the output is the CPU's."""
    done = run_python(SHARED_ITEM_PROGRAM, env={CACHE_ENV: str(tmp_path)}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "same as the CPU" in done.stdout
    assert "graph split into 2 compiled pieces around 1 op" in done.stderr and "special_zeta" in done.stderr
    assert "cannot be stored in the compile cache" not in done.stderr  # (AOTAutograd caches the method call)


class CacheWriteThenRead(torch.nn.Module):
    """A static cache's pattern around an op that splits the graph: write a row of the cache in
    place, then attend over the whole cache (which reads the placeholder, not the write)."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, position, x * 2)
        return torch.special.zeta(cache * cache + 1.5, 2.0).sum(0) * x  # zeta splits the graph


def test_a_split_graph_reads_a_tensor_after_its_in_place_write(cache):
    """The partitioner orders nodes by their inputs alone: a read of the cache must still come
    after the in-place write that precedes it in the graph."""
    model = CacheWriteThenRead()
    compiled = torch.compile(model, backend=regions.backend, fullgraph=True, dynamic=False)
    x, position = torch.randn(1, 8), torch.tensor([2])
    expected_cache = torch.zeros(4, 8)
    expected = model(x, expected_cache, position)
    device_cache = torch.zeros(4, 8, device="neuron")
    with recording_partitions() as reports, pytest.warns(UserWarning, match="graph split"):
        result = compiled(x.to("neuron"), device_cache, position.to("neuron"))
    assert reports and reports[0].compiled_pieces >= 1
    torch.testing.assert_close(device_cache.cpu(), expected_cache)
    torch.testing.assert_close(result.cpu(), expected)


def test_a_graph_reading_a_tensor_after_an_item_assignment_is_not_split(cache):
    """`cache[position] = ...` writes in place and returns nothing a read could follow: splitting
    such a graph could reorder the two, so it is refused (and generation degrades to eager)."""

    def write_then_read(x, cache):
        cache[2] = x * 2
        return torch.special.zeta(cache * cache + 1.5, 2.0).sum(0) * x

    compiled = torch.compile(write_then_read, backend=regions.backend, fullgraph=True, dynamic=False)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as raised:
        compiled(torch.randn(8, device="neuron"), torch.zeros(4, 8, device="neuron"))
    assert isinstance(raised.value.inner_exception, UnsupportedGraphError)
    assert re.search(r"node\(s\) setitem write into a tensor in place without returning it",
                     str(raised.value.inner_exception))


def test_the_library_s_backend_splits_a_graph_the_device_backend_refuses(cache):
    """TorchNeuron's backend compiles a graph whole or fails (it never splits): `compile_or_split`,
    under the library's compiled paths, splits a graph it refuses around the nodes that do not lower
    and hands it the pieces; a graph refused for another reason gets the backend's own error."""
    device_backend = torch._dynamo.backends.registry.lookup_backend("neuron")
    seen = []

    def whole_or_nothing(gm, example_inputs):  # TorchNeuron's contract: a graph Torch-MLIR cannot lower fails
        holds_zeta = any(node.target is torch.special.zeta for node in gm.graph.nodes)
        seen.append("refused" if holds_zeta else "compiled")
        if holds_zeta:
            raise RuntimeError("Neuron backend NEFF execution setup failed with unexpected error: special_zeta")
        return device_backend(gm, example_inputs)

    model, x = ZetaBetweenLinears(), torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model.to("neuron"), fullgraph=True, dynamic=False,
                                 backend=lambda gm, inputs: partition.compile_or_split(gm, inputs, whole_or_nothing))
        with recording_partitions() as reports, pytest.warns(UserWarning, match="graph split into 2 compiled pieces"):
            got = compiled(x.to("neuron"))
    torch.testing.assert_close(got.cpu(), expected)
    assert seen == ["refused", "compiled", "compiled"]
    assert [(report.compiled_pieces, report.fallback_nodes) for report in reports] == [(2, [ZETA])]

    def refuses_everything(gm, example_inputs):
        raise RuntimeError("the device backend's own failure")

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2, fullgraph=True, dynamic=False,
                             backend=lambda gm, inputs: partition.compile_or_split(gm, inputs, refuses_everything))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="the device backend's own failure"):
        compiled(torch.ones(2, device="neuron"))
