"""The compatibility report, on tiny models whose content is known: what it finds, the patches that
fix it, the verdict, the three renderings, and `optimum-cli neuron-torch check`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import optimum_neuron_torch as ont
from optimum_neuron_torch.compatibility import BLOCKED, NEEDS_PATCHES, RUNS_NATIVELY, RUNS_WITH_FALLBACKS
from optimum_neuron_torch.compiler.cache import cache_stats
from optimum_neuron_torch.errors import ArgumentTypeError
from optimum_neuron_torch.generation.buckets import distinct_programs
from optimum_neuron_torch.settings import COMPILE_CACHE_ENV, DISABLE_LAYER_REUSE_ENV
from test_patches import CASES
from testing_utils import optimum_cli
from tiny_models import TINY_MODELS

pytestmark = pytest.mark.filterwarnings("ignore:.*float64 in .* is computed in float32:UserWarning")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("check")
    return {name: TINY_MODELS[name].save(root / name) for name in ("llama", "gpt2", "bert", "bart", "t5")}


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "bart"])
def test_plain_architectures_run_natively(folders, name):
    report = ont.check(str(folders[name]))
    assert report.verdict == RUNS_NATIVELY, report.render()
    assert report.fallbacks == [] and report.graph_breaks == [] and report.unlowered_ops == []
    assert report.graph_count == 1 and report.compile_error is None
    assert report.stablehlo == "1 of 1 compiled graph(s) lower to StableHLO"
    assert [use.dtype for use in report.dtypes] == ["int64"]  # token ids: narrowed to int32 on TorchNeuron
    assert report.patches == [] and report.dynamic_shapes == []
    if name in ("llama", "gpt2"):  # the generative ones: the compile bill of their default buckets
        assert report.compile_bill[1].startswith("graphs to compile: ")
        assert "Compiled generation: the compile bill" in report.render()


def test_the_compile_bill_counts_the_graphs_of_the_buckets(folders):
    report = ont.check(str(folders["llama"]), compile=False)
    config = json.loads((folders["llama"] / "config.json").read_text())
    length = min(config["max_position_embeddings"], 2048)
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folders["llama"])
    assert report.compile_bill == model.compile_bill()
    assert report.compile_bill[0].startswith("buckets: batch sizes [1, 2, 4, 8], prompt buckets [16")
    assert f"max length {length}" in report.compile_bill[0]
    programs = distinct_programs(model.neuron_generation.graph_plan(), engine=True)
    assert report.compile_bill[2] == (f"distinct programs after layer reuse: {programs} (each graph: the code "
                                      f"before its {config['num_hidden_layers']} decoder layers, 1 layer program "
                                      "called for all of them, the code after; graphs of the same shapes share "
                                      "them)")
    bill = model.compile_bill(batch_sizes=(1,), prompt_buckets=(16,), max_length=64, context_buckets=(32,))
    assert bill[1] == "graphs to compile: 5 graphs: 1 prefill, 2 chunk, 2 decode"
    assert model.neuron_generation.buckets.batch_sizes == (1, 2, 4, 8)  # the bill changed nothing


@pytest.mark.parametrize("layer_reuse", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_the_bill_counts_the_programs_precompile_compiles(folders, layer_reuse, tmp_path, monkeypatch):
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(DISABLE_LAYER_REUSE_ENV, "0" if layer_reuse else "1")
    torch._dynamo.reset()
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folders["llama"])
    # a prefill, two chunks, two decode steps and two sampling decode steps: programs shared between them
    buckets = dict(batch_sizes=(1,), prompt_buckets=(16,), max_length=64, context_buckets=(32,))
    bill = model.compile_bill(**buckets, sampling=True)
    before = cache_stats()
    model.precompile(show_progress=False, sampling=True, **buckets)
    compiled = cache_stats().misses - before.misses
    assert bill[1] == "graphs to compile: 7 graphs: 1 prefill, 2 chunk, 2 decode, 2 sampling decode"
    expected = "distinct programs after layer reuse: " if layer_reuse else "distinct programs: "
    assert bill[2].startswith(f"{expected}{compiled} (") and compiled == (13 if layer_reuse else 7)


def test_t5_relative_position_buckets_fall_back(folders):
    report = ont.check(str(folders["t5"]))
    assert report.verdict == RUNS_WITH_FALLBACKS and report.falls_back
    [fallback] = report.fallbacks
    assert fallback.op == "aten::minimum.out"  # torch.min(bucket, max) in T5's relative position bucket
    assert set(fallback.modules) == {
        "T5ForConditionalGeneration.encoder.block.0.layer.0.SelfAttention",  # only block 0 computes the bias
        "T5ForConditionalGeneration.decoder.block.0.layer.0.SelfAttention",
    }
    assert fallback.calls == sum(fallback.modules.values())
    assert report.graph_breaks == [] and report.graph_count == 1  # compiled, the op lowers fine


def test_complex_rope_is_reported_then_fixed_by_its_patch():
    model = CASES["llama4"].build()
    unpatched = ont.check(model, patches=False, compile=False)
    assert unpatched.verdict == BLOCKED
    [complex_use] = [use for use in unpatched.dtypes if use.dtype == "complex64"]
    assert "aten::view_as_complex" in complex_use.ops
    assert {"Llama4ForCausalLM.model.rotary_emb",
            "Llama4ForCausalLM.model.layers.0.self_attn"} <= set(complex_use.modules)

    report = ont.check(model)
    assert report.verdict == NEEDS_PATCHES
    assert [patch.name for patch in report.patches] == ["complex_rope"]
    assert [use.dtype for use in report.unpatched_dtypes] == ["complex64"]
    assert all(not use.dtype.startswith("complex") for use in report.dtypes)
    assert report.graph_breaks == [] and report.unlowered_ops == [] and report.compile_error is None
    assert getattr(model, "neuron_patches", []) == []  # the check reverted its patch


@pytest.mark.slow
def test_nonzero_routing_is_reported_then_fixed_by_its_patch():
    model = CASES["mixtral"].build()  # experts_implementation="eager": the nonzero loop
    unpatched = ont.check(model, patches=False)
    assert unpatched.verdict == RUNS_WITH_FALLBACKS
    [nonzero] = unpatched.dynamic_shapes
    assert nonzero.op == "aten::nonzero"
    assert set(nonzero.modules) == {f"MixtralForCausalLM.model.layers.{i}.mlp.experts" for i in range(2)}
    assert unpatched.graph_breaks and all("Dynamic shape operator" in item.reason for item in unpatched.graph_breaks)
    assert all("modeling_mixtral.py" in item.location for item in unpatched.graph_breaks)

    report = ont.check(model)
    assert report.verdict == NEEDS_PATCHES
    assert [patch.name for patch in report.patches] == ["static_moe_experts"]
    assert [item.op for item in report.unpatched_dynamic_shapes] == ["aten::nonzero"]
    assert report.dynamic_shapes == [] and report.graph_breaks == [] and report.graph_count == 1


def test_float64_is_reported_then_narrowed_by_its_patch():
    case = CASES["aimv2"]
    report = ont.check(case.build(), case.inputs(), compile=False)
    assert [patch.name for patch in report.patches] == ["float64_to_float32"]
    [float64] = report.unpatched_dtypes
    assert float64.dtype == "float64" and float64.treatment.startswith("narrowed to float32")
    assert report.verdict == NEEDS_PATCHES


class Zeta(torch.nn.Module):
    """linear -> special.zeta (no StableHLO lowering) -> argmax (no native eager kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.zeta(self.linear(x).abs() + 2, 1.5).argmax(-1)


def test_a_hand_built_module_reports_fallbacks_and_unlowered_ops():
    torch.manual_seed(0)
    report = ont.check(Zeta(), {"x": torch.randn(4, 8)})
    assert report.verdict == RUNS_WITH_FALLBACKS and report.falls_back
    assert {item.op: item.modules for item in report.fallbacks} == {
        "aten::argmax.out": {"Zeta": 1}, "aten::special_zeta.out": {"Zeta": 1},
    }
    assert any("zeta" in item.op and "StableHLO" in item.reason for item in report.unlowered_ops), report.unlowered_ops
    # Compiled as the library's paths compile (split), with what TorchNeuron's own backend would do with it.
    assert report.compile_error is None
    assert ("split around torch._C._special.special_zeta, which then run eagerly; TorchNeuron's own "
            "torch.compile(backend='neuron') refuses such a graph") in report.render()


class ZetaOfTwo(torch.nn.Module):
    """Two positional tensors: linear(x) + y -> special.zeta -> argmax (two fallbacks)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.special.zeta((self.linear(x) + y).abs() + 2, 1.5).argmax(-1)


def test_positional_example_inputs_give_the_report_of_keyword_ones():
    torch.manual_seed(0)
    model, x, y = ZetaOfTwo(), torch.randn(4, 8), torch.randn(4, 8)
    by_name = ont.check(model, {"x": x, "y": y})
    by_position = ont.check(model, (x, y))  # as torch.export / torch.compile users pass them
    assert by_position.eager_error is None and by_position.compile_error is None  # tensors moved to the device
    assert {item.op for item in by_position.fallbacks} == {"aten::argmax.out", "aten::special_zeta.out"}
    assert by_position.to_dict() == by_name.to_dict()
    as_list = ont.check(model, [x, y], compile=False)
    assert as_list.eager_error is None and as_list.fallbacks == by_name.fallbacks


def test_example_inputs_of_another_type_are_refused():
    with pytest.raises(ArgumentTypeError, match=r"^check\(\): `example_inputs` takes a dict of keyword arguments or a "
                       r"tuple \(or list\) of positional arguments of the model's forward, not Tensor\.$"):
        ont.check(Zeta(), torch.randn(4, 8))


def test_renderings_agree(folders):
    report = ont.check(str(folders["t5"]), compile=False)
    text, markdown = report.render(), report.render("markdown")
    assert "verdict: runs with fallbacks" in text and "aten::minimum.out: 3 calls" in text
    assert "**Verdict: runs with fallbacks**" in markdown and "## Ops that fall back to the CPU" in markdown
    data = json.loads(report.render("json"))
    assert data["verdict"] == RUNS_WITH_FALLBACKS and data["fallbacks"][0]["op"] == "aten::minimum.out"
    assert data["graph_count"] is None  # compile=False
    with pytest.raises(ValueError, match="unknown report format 'html'"):
        report.render("html")


def test_cli_check_formats_strict_and_errors(folders, tmp_path):
    strict = optimum_cli("check", str(folders["t5"]), "--format", "json", "--strict", "--no-compile")
    assert strict.returncode == 1, strict.stderr
    assert json.loads(strict.stdout)["fallbacks"][0]["op"] == "aten::minimum.out"

    clean = optimum_cli("check", str(folders["llama"]), "--strict", "--format", "markdown")
    assert clean.returncode == 0, clean.stderr
    assert "**Verdict: runs natively**" in clean.stdout and "dtype `float32`" in clean.stdout

    narrowed = optimum_cli("check", "--model", str(folders["llama"]), "--dtype", "bfloat16", "--no-compile",
                           "--format", "json")
    assert narrowed.returncode == 0, narrowed.stderr
    assert json.loads(narrowed.stdout)["dtype"] == "bfloat16"

    missing = optimum_cli("check", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stdout == ""
    [line] = missing.stderr.strip().splitlines()
    assert line.startswith(f"error: cannot check {tmp_path / 'nowhere'}:")


class ReflectPad(torch.nn.Module):
    """Reflection padding: native forward, a backward (reflection_pad1d_backward) TorchNeuron lacks."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(self.linear(x)[None], (2, 2), mode="reflect")


def test_training_check_reports_what_only_the_backward_pass_hits():
    inference = ont.check(ReflectPad(), {"x": torch.randn(4, 8)})
    assert inference.verdict == RUNS_NATIVELY and not inference.training
    report = ont.check(ReflectPad(), {"x": torch.randn(4, 8)}, training=True)
    assert report.fallbacks == [] and report.training_error is None and report.training_compile_error is None
    assert [(item.op, item.modules) for item in report.backward_fallbacks] == [
        ("aten::reflection_pad1d_backward.grad_input", {"<backward pass>": 1})
    ]
    assert report.verdict == RUNS_WITH_FALLBACKS and report.falls_back
    text = report.render()
    assert "Ops the backward pass sends to the CPU:\n  - aten::reflection_pad1d_backward.grad_input: 1 calls" in text
    assert "StableHLO lowering of the training graphs" in report.render("markdown")
    assert json.loads(report.render("json"))["backward_fallbacks"][0]["calls"] == 1


@pytest.mark.slow
def test_training_check_of_a_language_model_and_the_cli(folders):
    report = ont.check(str(folders["llama"]), training=True)
    assert report.training and report.training_error is None and report.training_compile_error is None
    assert report.backward_fallbacks == [] and report.training_graph_breaks == []
    # the forward graph lowers; what Torch-MLIR makes of the backward graph is reported either way
    assert report.training_stablehlo.endswith("of 2 forward and backward graph(s) lower to StableHLO")
    assert not any(item.op.startswith("forward") for item in report.training_unlowered_ops)
    cli = optimum_cli("check", str(folders["llama"]), "--training", "--format", "json")
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["training"] is True
