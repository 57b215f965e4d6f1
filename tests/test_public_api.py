"""Public functions that the other tests reach only through the library's own calls, each called as
a user would call it (tests/test_tiers.py checks that the fast tier names every public function)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, LlamaForCausalLM

import optimum_neuron_torch
from optimum_neuron_torch.compatibility import default_inputs
from optimum_neuron_torch.loading import load_pretrained
from optimum_neuron_torch.modeling import (
    NeuronAutoModel,
    NeuronAutoModelForCausalLM,
    NeuronAutoModelForSeq2SeqLM,
    neuron_auto_class_for,
)
from optimum_neuron_torch.patches import PATCHES, ModelPatch, register_patch
from optimum_neuron_torch.training import SAVE_RANDOM_OPS, save_random_ops_when_checkpointing
from testing_utils import assert_same
from tiny_models import TINY_MODELS


def test_load_pretrained_gives_the_class_asked_for_with_the_checkpoints_weights(tmp_path):
    folder = TINY_MODELS["llama"].save(tmp_path / "llama")
    model = load_pretrained(LlamaForCausalLM, folder)
    cpu = LlamaForCausalLM.from_pretrained(folder).eval()
    ids = torch.arange(3, 12).unsqueeze(0)
    assert type(model) is LlamaForCausalLM and model.device.type == "neuron"
    with torch.no_grad():
        assert_same(model(ids.to("neuron")).logits, cpu(ids).logits, atol=1e-5, rtol=1e-5)


def test_neuron_auto_class_for_follows_the_architecture(tmp_path):
    for name, expected in (("llama", NeuronAutoModelForCausalLM), ("t5", NeuronAutoModelForSeq2SeqLM)):
        config = AutoConfig.from_pretrained(TINY_MODELS[name].save(tmp_path / name))
        assert neuron_auto_class_for(config) is expected
    config.architectures = ["SomethingElse"]
    assert neuron_auto_class_for(config) is NeuronAutoModel


def test_default_inputs_are_seeded_token_ids_with_a_mask():
    model = TINY_MODELS["t5"].build()
    first, second = default_inputs(model, 10), default_inputs(model, 10)
    assert first["input_ids"].shape == (1, 10) and torch.equal(first["input_ids"], second["input_ids"])
    assert torch.equal(first["attention_mask"], torch.ones(1, 10, dtype=torch.long))
    assert first["decoder_input_ids"].shape == (1, 5) and first["use_cache"] is False


def test_the_backends_fallback_mode_refuses_or_allows_ops_without_a_native_kernel():
    backend = optimum_neuron_torch.backend_info()
    previous = backend.fallback_mode()
    x = torch.rand(4).to("neuron")
    try:
        backend.set_fallback_mode("error")
        with pytest.raises(NotImplementedError, match="lgamma"):
            torch.lgamma(x)
        backend.set_fallback_mode("silent")
        assert_same(torch.lgamma(x), torch.lgamma(x.cpu()))
        with pytest.raises(ValueError, match="unknown fallback policy 'loud'"):
            backend.set_fallback_mode("loud")
        assert backend.fallback_mode() == "silent"
    finally:
        backend.set_fallback_mode(previous)


def test_register_patch_adds_a_named_patch_once():
    patch = ModelPatch(name="test_public_api_patch", description="does nothing", architectures=(),
                       applies=lambda model: False, apply=lambda model: (lambda: None))
    try:
        assert register_patch(patch) is patch and PATCHES["test_public_api_patch"] is patch
        with pytest.raises(ValueError, match="'test_public_api_patch' is already registered"):
            register_patch(patch)
    finally:
        PATCHES.pop("test_public_api_patch", None)


def test_save_random_ops_when_checkpointing_gives_checkpointing_the_policy():
    model = TINY_MODELS["llama"].build()
    save_random_ops_when_checkpointing(model)
    model.activation_checkpointing_enable()
    layer = model.model.layers[0]
    assert layer.gradient_checkpointing
    assert layer._gradient_checkpointing_func.keywords == {"use_reentrant": False, "context_fn": SAVE_RANDOM_OPS}
    del model.activation_checkpointing_enable  # undone as its docstring says: Transformers' own again
    model.activation_checkpointing_enable()
    assert "context_fn" not in layer._gradient_checkpointing_func.keywords
