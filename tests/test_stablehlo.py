"""The StableHLO lowering check: with the `stablehlo` extra installed (the test command installs
it), every compiled graph is kept with its StableHLO text, weights as inputs."""

from __future__ import annotations

import re

import pytest
import torch

from optimum_neuron_torch.compiler import CompileCache, partition, regions
from optimum_neuron_torch.compiler.artifact import STABLEHLO_FILE
from optimum_neuron_torch.generation import Buckets, enable_compiled_generation
from optimum_neuron_torch.settings import COMPILE_CACHE_ENV as CACHE_ENV
from tiny_models import PROGRAMS_PER_GRAPH, TINY_MODELS


def test_compiled_generation_graphs_are_kept_with_their_stablehlo(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    torch._dynamo.reset()
    model = enable_compiled_generation(TINY_MODELS["llama"].build().to("neuron"), Buckets((1,), (8,), 32))
    model.generate(torch.randint(4, 128, (1, 5)).to("neuron"), max_new_tokens=3, do_sample=False)
    entries = [entry for entry in CompileCache(tmp_path).entries() if not entry.is_function]
    assert len(entries) == 2 * PROGRAMS_PER_GRAPH  # prefill and decode
    layer_parameters = sum(1 for _ in model.model.layers[0].parameters())
    layers = []
    for entry in entries:
        assert entry.metadata["stablehlo"] == "ok"
        text = (entry.path / STABLEHLO_FILE).read_text()
        assert "torch." not in text  # fully lowered, nothing left in the torch dialect
        assert "dense_resource" not in text  # the weights are inputs, not constants
        signature = re.search(r"func\.func @main\((.*?)\) ->", text).group(1)
        if "stablehlo.dot_general" in text and signature.count("%arg") >= layer_parameters:
            layers.append(entry)
    assert len(layers) >= 2  # a decoder layer (its weights its inputs) in the prefill, another in the decode step


def test_a_graph_of_ops_that_do_not_lower_is_refused_by_the_device_backend_and_runs_eagerly_by_the_library_s(
        tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    zeta = lambda x: torch.special.zeta(x, 2.0)  # noqa: E731
    x = torch.tensor([2.0, 3.0])
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="no StableHLO lowering for aten.special_zeta"):
        torch.compile(zeta, backend="neuron", dynamic=False)(x.to("neuron"))
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="graph split into 0 compiled pieces around 1 op"):
        result = torch.compile(zeta, backend=regions.backend, dynamic=False)(x.to("neuron"))
    torch.testing.assert_close(result.cpu(), zeta(x))
    assert list(CompileCache(tmp_path).entries()) == []  # nothing to compile: the one node runs eagerly


def test_a_graph_that_does_not_lower_with_no_node_to_blame_warns_and_still_runs(tmp_path, monkeypatch):
    # Torch-MLIR failing on the whole graph but on none of its nodes alone (its release may differ from
    # TorchNeuron's there): the graph is compiled, with the warning, since no node can be named.
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(partition, "failing_to_lower", lambda gm: {})
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.special.zeta(x, 2.0), backend="neuron", dynamic=False)
    x = torch.tensor([2.0, 3.0])
    with pytest.warns(UserWarning, match="does not lower to StableHLO, so TorchNeuron could not compile it"):
        result = compiled(x.to("neuron"))
    torch.testing.assert_close(result.cpu(), torch.special.zeta(x, 2.0))
    (entry,) = CompileCache(tmp_path).entries()
    assert entry.metadata["stablehlo"] != "ok" and not (entry.path / STABLEHLO_FILE).exists()


@pytest.mark.parametrize("case", ["causal", "mask"])
def test_the_lowered_attention_backward_is_sdpa_s_gradient(case):
    # The decomposition the lowering check gives the device's fused attention backward (grouped-query
    # attention: 4 query heads share 2 key-value heads) against autograd through the CPU's attention.
    from optimum_neuron_torch.compiler.stablehlo import _fused_attention_backward

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 6, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(2, 2, 6, 8, generator=generator, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(2, 4, 6, 8, generator=generator)
    mask = torch.rand(2, 1, 6, 6, generator=generator) > 0.3 if case == "mask" else None
    if mask is not None:
        mask[..., 0] = True  # every query sees a key
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                           is_causal=case == "causal", scale=0.3, enable_gqa=True)
    expected = torch.autograd.grad(out, (query, key, value), grad_out)
    got = _fused_attention_backward(grad_out, query.detach(), key.detach(), value.detach(), mask, [True] * 4, out,
                                    None, None, None, 6, 6, 0.0, case == "causal", None, None, scale=0.3)
    assert got[3] is None
    for actual, wanted in zip(got[:3], expected, strict=True):
        torch.testing.assert_close(actual, wanted)
