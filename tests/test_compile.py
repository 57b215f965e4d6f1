"""The `neuron` torch.compile backend: Inductor's C++ code generation on the device."""

from __future__ import annotations

import copy

import pytest
import torch

import optimum_neuron_torch  # noqa: F401
from tiny_models import TINY_MODELS


@pytest.fixture(scope="module")
def llama():
    return TINY_MODELS["llama"].build()


def test_backend_is_registered_by_entry_point():
    assert "neuron" in torch._dynamo.list_backends()


def test_compiled_forward_matches_cpu_and_does_not_recompile(llama):
    torch._dynamo.reset()
    model = copy.deepcopy(llama).to("neuron")
    compiled = torch.compile(model, backend="neuron", fullgraph=True, dynamic=False)
    ids = torch.randint(4, 128, (2, 12))
    with torch.no_grad():
        expected = llama(ids).logits
        first = compiled(ids.to("neuron")).logits
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        second = compiled(torch.randint(4, 128, (2, 12)).to("neuron")).logits
    assert first.device.type == "neuron" and second.device.type == "neuron"
    torch.testing.assert_close(first.cpu(), expected, rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames  # same shape: no new graph


def test_dynamic_shapes_are_rejected_like_torchneuron():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2 + 1, backend="neuron", dynamic=True)
    with pytest.raises(Exception,
                       match="Dynamic shapes detected in the model, but torch-neuronx requires static shapes"):
        compiled(torch.ones(4, device="neuron"))


def test_other_modes_warn_and_compile_as_default():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.relu(x) * 3, backend="neuron", mode="max-autotune", dynamic=False)
    with pytest.warns(UserWarning, match="mode 'max-autotune' is not supported by the neuron backend"):
        out = compiled(torch.tensor([-1.0, 2.0], device="neuron"))
    assert out.device.type == "neuron" and out.cpu().tolist() == [0.0, 6.0]


@pytest.mark.slow
def test_transformers_static_cache_generate_compiles_its_decode_step(llama):
    """Transformers auto-compiles the decode step on a `neuron` device with a static cache and picks
    backend "neuron": the greedy tokens equal the CPU's."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = copy.deepcopy(llama).to("neuron")
    ids = torch.randint(4, 128, (1, 6))
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    expected = llama.generate(ids, **settings)
    generated = model.generate(ids.to("neuron"), cache_implementation="static", **settings)
    assert generated.cpu().tolist() == expected.tolist()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the decode step was compiled


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_compiled_convolution_gives_the_cpus_output_in_its_layout(mode):
    """A patch embedding (a vision encoder's convolution), compiled, under no_grad and under
    inference_mode (what Transformers' pipelines run in): the CPU's values, in the layout the
    convolution gives eagerly (Inductor's layout optimization, off on the device, would expect
    channels-last outputs the host's kernel does not give)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    embedding, pixels = torch.nn.Conv2d(3, 32, 8, stride=8), torch.randn(2, 3, 32, 32)
    with mode():
        expected = embedding(pixels)
        compiled = torch.compile(copy.deepcopy(embedding).to("neuron"), backend="neuron", fullgraph=True)
        output = compiled(pixels.to("neuron"))
    assert output.stride() == expected.stride()
    torch.testing.assert_close(output.cpu(), expected)


def test_a_convolution_lays_its_result_out_as_its_meta_function_says():
    """A 1 x 1 convolution of one input channel over a transposed input (FastSpeech2's duration
    predictor): the CPU's kernel gives a channels-last result (its weight looks channels-last), the
    op's meta function a contiguous one, by which a compiled graph is planned. The device gives what
    the meta function says, eagerly and compiled (Inductor checks it): the CPU's values."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    weight, values = torch.randn(32, 1, 1), torch.randn(1, 10, 1)

    def project(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv1d(values.transpose(1, 2), weight) * 2

    expected = project(values, weight)
    meta = torch.nn.functional.conv1d(values.transpose(1, 2).to("meta"), weight.to("meta"))
    assert expected.stride() != meta.stride() == (320, 10, 1)  # (the CPU's kernel and the meta function differ)
    for _ in range(3):  # (each result a new tensor, which must never pass for an argument the call released)
        eager = torch.nn.functional.conv1d(values.transpose(1, 2).to("neuron"), weight.to("neuron"))
        assert eager.stride() == meta.stride()
        torch.testing.assert_close(eager.cpu(), expected / 2)
    compiled = torch.compile(project, backend="neuron", fullgraph=True)(values.to("neuron"), weight.to("neuron"))
    torch.testing.assert_close(compiled.cpu(), expected)
