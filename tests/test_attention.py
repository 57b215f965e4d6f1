"""The engine's attention: grouped key/value heads read in place, with Transformers' SDPA results."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from transformers import AttentionInterface, LlavaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from optimum_neuron_torch.generation import Buckets, enable_compiled_generation
from optimum_neuron_torch.generation.attention import PACKED_SDPA, packed_attention, packed_sdpa_attention
from tiny_models import TINY_MODELS, VOCAB


class Attention(torch.nn.Module):
    """What Transformers' attention functions read of a model's attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def attention_inputs(rows: int, heads: int, kv_heads: int, tokens: int, keys: int, mask_kind: str):
    generator = torch.Generator().manual_seed(rows * 1000 + tokens)
    query = torch.randn(rows, tokens, heads, 16, generator=generator).transpose(1, 2)  # (as a model's projection)
    key, value = (torch.randn(rows, kv_heads, keys, 16, generator=generator) for _ in range(2))
    allowed = torch.rand(rows, 1, tokens, keys, generator=generator) > 0.3
    allowed[..., 0] = True
    if mask_kind == "additive":
        return query, key, value, torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    if mask_kind == "shared by the batch":
        return query, key, value, allowed[:1]
    return query, key, value, allowed


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "shared by the batch"])
@pytest.mark.parametrize("tokens", [1, 5], ids=["decode step", "prefill piece"])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)], ids=["3 groups", "no groups"])
def test_packed_attention_equals_transformers_sdpa_attention_on_the_device(heads, kv_heads, tokens, mask_kind):
    query, key, value, mask = (tensor.to("neuron") for tensor in attention_inputs(3, heads, kv_heads, tokens, 40,
                                                                                  mask_kind))
    module = Attention(heads // kv_heads)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    output, weights = packed_sdpa_attention(module, query, key, value, mask, scaling=0.25)
    assert weights is None and output.shape == expected.shape == (3, tokens, heads, 16)
    torch.testing.assert_close(output.cpu(), expected.cpu(), rtol=1e-5, atol=1e-6)


def test_packed_attention_takes_a_mask_shared_by_the_tokens():
    """A mask whose query dimension is 1 holds for every token, as SDPA broadcasts it."""
    query, key, value, mask = attention_inputs(2, 6, 2, 4, 40, "bool")
    mask = mask[:, :, :1]
    expected, _ = sdpa_attention_forward(Attention(3), query, key, value, mask)
    output, _ = packed_sdpa_attention(Attention(3), query, key, value, mask)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


def test_packed_attention_without_a_mask_is_transformers_causal_sdpa():
    """A causal flag aligns with query rows, which packing reorders: without a mask nothing is packed."""
    query, key, value, _ = attention_inputs(2, 4, 2, 6, 6, "bool")
    expected, _ = sdpa_attention_forward(Attention(2), query, key, value, None)
    output, _ = packed_sdpa_attention(Attention(2), query, key, value, None)
    assert torch.equal(output, expected)


def test_packed_attention_is_scoped_to_sdpa_models():
    sdpa = TINY_MODELS["llama"].build()
    eager = copy.deepcopy(sdpa)
    eager.set_attn_implementation("eager")
    with packed_attention(sdpa), packed_attention(eager):
        assert (sdpa.config._attn_implementation, eager.config._attn_implementation) == (PACKED_SDPA, "eager")
    assert (sdpa.config._attn_implementation, eager.config._attn_implementation) == ("sdpa", "eager")
    with pytest.raises(RuntimeError), packed_attention(sdpa):
        raise RuntimeError("a step failed")
    assert sdpa.config._attn_implementation == "sdpa"


def test_packed_attention_restores_each_sub_config_s_own_choice():
    """A composite model (a vision tower with eager attention beside an SDPA text model): only the SDPA
    parts switch, and each part gets its own choice back."""
    config = LlavaConfig(text_config=dict(model_type="llama", num_hidden_layers=1),
                         vision_config=dict(model_type="clip_vision_model", num_hidden_layers=1))
    config._attn_implementation = {"": "sdpa", "text_config": "sdpa", "vision_config": "eager"}
    model = types.SimpleNamespace(config=config)
    with packed_attention(model):
        assert (config._attn_implementation, config.text_config._attn_implementation,
                config.vision_config._attn_implementation) == (PACKED_SDPA, PACKED_SDPA, "eager")
    assert (config._attn_implementation, config.text_config._attn_implementation,
            config.vision_config._attn_implementation) == ("sdpa", "sdpa", "eager")


def test_the_engine_s_steps_read_grouped_heads_in_place_and_match_eager(monkeypatch):
    """The tiny Llama has 2 query heads per key/value head: its steps run the packed attention (traced
    once per graph), its tokens are Transformers' on the CPU, and the model is SDPA again after."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return packed_sdpa_attention(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, PACKED_SDPA, counted)
    torch._dynamo.reset()  # (traced anew, with the counting function)
    cpu = TINY_MODELS["llama"].build()
    model = enable_compiled_generation(copy.deepcopy(cpu).to("neuron"),
                                       Buckets(batch_sizes=(1,), prompt_buckets=(8,), max_length=32))
    prompt = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    expected = cpu.generate(prompt, max_new_tokens=5, do_sample=False)
    output = model.generate(prompt.to("neuron"), max_new_tokens=5, do_sample=False)
    assert torch.equal(output.cpu(), expected)
    assert {shape[1:3] for shape in calls} == {(4, 8), (4, 1)}  # the prefill and the decode step's queries
    assert model.config._attn_implementation == "sdpa"
