"""A tiny Llama built from a config (no downloads) runs on `neuron` exactly as on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def test_forward_logits_match_cpu(tiny_llama):
    device_model = copy.deepcopy(tiny_llama).to("neuron")
    assert all(p.device.type == "neuron" for p in device_model.parameters())
    input_ids = torch.randint(3, 256, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0  # left padding
    with torch.no_grad():
        expected = tiny_llama(input_ids, attention_mask=attention_mask).logits
        logits = device_model(input_ids.to("neuron"), attention_mask=attention_mask.to("neuron")).logits
    assert logits.device.type == "neuron"
    torch.testing.assert_close(logits.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_greedy_generate_matches_cpu(tiny_llama):
    device_model = copy.deepcopy(tiny_llama).to("neuron")
    input_ids = torch.randint(3, 256, (1, 7))
    settings = dict(max_new_tokens=12, do_sample=False, min_new_tokens=12)
    expected = tiny_llama.generate(input_ids, **settings)
    generated = device_model.generate(input_ids.to("neuron"), **settings)
    assert generated.device.type == "neuron"
    assert generated.cpu().tolist() == expected.tolist()


def test_sampled_generate_is_reproducible_on_the_device(tiny_llama):
    device_model = copy.deepcopy(tiny_llama).to("neuron")
    input_ids = torch.randint(3, 256, (1, 5), device="neuron")
    settings = dict(max_new_tokens=10, do_sample=True, top_k=20, top_p=0.9, temperature=0.8)
    torch.manual_seed(42)
    first = device_model.generate(input_ids, **settings).cpu()
    torch.manual_seed(42)
    assert torch.equal(device_model.generate(input_ids, **settings).cpu(), first)
