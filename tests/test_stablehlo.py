"""The StableHLO lowering check: with the `stablehlo` extra installed (the test command installs
it), every compiled graph is kept with its StableHLO text, weights as inputs."""

from __future__ import annotations

import re

import pytest
import torch

from optimum_neuron_torch.compiler import CompileCache
from optimum_neuron_torch.compiler.artifact import STABLEHLO_FILE
from optimum_neuron_torch.generation import Buckets, enable_compiled_generation
from optimum_neuron_torch.settings import COMPILE_CACHE_ENV as CACHE_ENV
from tiny_models import TINY_MODELS


def test_compiled_generation_graphs_are_kept_with_their_stablehlo(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    torch._dynamo.reset()
    model = enable_compiled_generation(TINY_MODELS["llama"].build().to("neuron"), Buckets((1,), (8,), 32))
    model.generate(torch.randint(4, 128, (1, 5)).to("neuron"), max_new_tokens=3, do_sample=False)
    entries = list(CompileCache(tmp_path).entries())
    assert len(entries) == 2  # prefill and decode
    parameters = sum(1 for _ in model.parameters())
    for entry in entries:
        assert entry.metadata["stablehlo"] == "ok"
        text = (entry.path / STABLEHLO_FILE).read_text()
        # fully lowered, nothing left in the torch dialect
        assert "stablehlo.dot_general" in text and "torch." not in text
        signature = re.search(r"func\.func @main\((.*?)\) ->", text).group(1)
        assert signature.count("%arg") > parameters  # the weights are inputs, not constants
        assert "dense_resource" not in text


def test_a_graph_that_does_not_lower_warns_and_still_runs(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.special.zeta(x, 2.0), backend="neuron", dynamic=False)
    x = torch.tensor([2.0, 3.0])
    with pytest.warns(UserWarning, match="does not lower to StableHLO, so TorchNeuron could not compile it"):
        result = compiled(x.to("neuron"))
    torch.testing.assert_close(result.cpu(), torch.special.zeta(x, 2.0))
    (entry,) = CompileCache(tmp_path).entries()
    assert entry.metadata["stablehlo"] != "ok" and not (entry.path / STABLEHLO_FILE).exists()
