"""Ops on the device match the CPU: autograd, optimizers, serialization, views and `out=`,
autocast, and the entry points PyTorch reserves for accelerators (fused attention, convolution,
RNN cells)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from optimum_neuron_torch.device import clear_op_tracking, executed_ops
from testing_utils import assert_same


def test_autograd_and_an_optimizer_step_match_cpu():
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                    torch.nn.Linear(16, 3))
    device_model = copy.deepcopy(cpu_model).to("neuron")
    x, target = torch.randn(4, 8), torch.tensor([0, 2, 1, 2])
    for model, optimizer_device in ((cpu_model, "cpu"), (device_model, "neuron")):
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x.to(optimizer_device)), target.to(optimizer_device))
            loss.backward()
            optimizer.step()
    for cpu_param, device_param in zip(cpu_model.parameters(), device_model.parameters(), strict=True):
        assert_same(device_param.detach(), cpu_param.detach(), rtol=1e-5, atol=1e-6)
        assert device_param.grad.device.type == "neuron"


def test_save_and_load_round_trip():
    state = {"w": torch.randn(3, 4, device="neuron"), "i": torch.arange(5, device="neuron"), "view": None}
    state["view"] = state["w"][1]  # shares storage with "w"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["w"].device.type == "neuron"
    assert torch.equal(loaded["w"].cpu(), state["w"].cpu())
    assert torch.equal(loaded["i"].cpu(), state["i"].cpu())
    loaded["w"][1].fill_(0)
    assert loaded["view"].cpu().eq(0).all()  # storage sharing survives
    buffer.seek(0)
    on_cpu = torch.load(buffer, map_location="cpu", weights_only=True)
    assert on_cpu["w"].device.type == "cpu" and torch.equal(on_cpu["w"], state["w"].cpu())


def test_views_and_in_place_ops_share_memory():
    base = torch.zeros(4, 4, device="neuron")
    base[1:3, 1:3] += 1
    base.t()[0].fill_(5)
    expected = torch.zeros(4, 4)
    expected[1:3, 1:3] += 1
    expected.t()[0].fill_(5)
    assert_same(base, expected)
    view = base.view(16)
    view.mul_(2)
    assert_same(base, expected * 2)


def test_out_arguments_are_resized_and_written():
    out = torch.empty(0, device="neuron")
    result = torch.add(torch.ones(3, device="neuron"), 1, out=out)
    assert result is out and out.shape == (3,)
    assert_same(out, torch.full((3,), 2.0))
    values, indices = torch.empty(0, device="neuron"), torch.empty(0, dtype=torch.long, device="neuron")
    torch.sort(torch.tensor([3.0, 1.0, 2.0], device="neuron"), out=(values, indices))
    assert values.cpu().tolist() == [1.0, 2.0, 3.0] and indices.cpu().tolist() == [1, 2, 0]


def test_mixed_scalars_and_cpu_scalar_tensors():
    x = torch.tensor([1.0, 2.0], device="neuron")
    assert_same(x + torch.tensor(3.0), torch.tensor([4.0, 5.0]))
    assert_same(x * 2 - 1, torch.tensor([1.0, 3.0]))
    assert x.sum().item() == 3.0


def test_autocast_runs_matrix_products_in_bfloat16():
    a, b = torch.randn(8, 8, device="neuron"), torch.randn(8, 8, device="neuron")
    with torch.autocast("neuron", dtype=torch.bfloat16):  # (Trainium's lower precision; the default is float16)
        product = a @ b
        normalized = torch.nn.functional.layer_norm(product, (8,))
    assert product.dtype == torch.bfloat16
    assert normalized.dtype == torch.float32
    assert_same(product, (a.cpu().bfloat16() @ b.cpu().bfloat16()))


@pytest.mark.parametrize("causal, kv_heads", [(False, 4), (True, 4), (True, 2)])
def test_attention_uses_the_fused_kernel_and_matches_cpu(causal, kv_heads):
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 8, 16, requires_grad=True) for _ in range(2))
    gqa = kv_heads != 4
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    expected.sum().backward()
    cpu_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    clear_op_tracking()
    dq, dk, dv = (t.detach().to("neuron").requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(dq, dk, dv, is_causal=causal, enable_gqa=gqa)
    assert "aten::_scaled_dot_product_fused_attention_overrideable" in executed_ops()
    assert_same(out.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
    out.sum().backward()
    for device_tensor, cpu_grad in zip((dq, dk, dv), cpu_grads, strict=True):
        assert_same(device_tensor.grad, cpu_grad, atol=1e-5, rtol=1e-5)


def test_attention_with_a_mask_matches_cpu():
    q = torch.randn(1, 2, 5, 8)
    mask = torch.rand(5, 5) > 0.3
    mask[:, 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    out = torch.nn.functional.scaled_dot_product_attention(*(q.to("neuron"),) * 3, attn_mask=mask.to("neuron"))
    assert_same(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_convolution_forward_and_backward(transposed):
    torch.manual_seed(0)
    layer = torch.nn.ConvTranspose2d(3, 4, 3, stride=2) if transposed else torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    layer(x).square().sum().backward()
    cpu_grads = (x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone())
    device_layer = copy.deepcopy(layer).to("neuron")
    device_layer.zero_grad()
    dx = x.detach().to("neuron").requires_grad_()
    out = device_layer(dx)
    assert_same(out.detach(), layer(x).detach(), atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    for device_grad, cpu_grad in zip((dx.grad, device_layer.weight.grad, device_layer.bias.grad), cpu_grads,
                                     strict=True):
        assert_same(device_grad, cpu_grad, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU])
def test_recurrent_layers_forward_and_backward(cell):
    torch.manual_seed(0)
    layer = cell(4, 8, num_layers=2)
    x = torch.randn(5, 2, 4, requires_grad=True)
    out, _ = layer(x)
    out.sum().backward()
    cpu_input_grad = x.grad.clone()
    cpu_weight_grad = layer.weight_hh_l0.grad.clone()
    device_layer = copy.deepcopy(layer).to("neuron")
    device_layer.zero_grad()
    dx = x.detach().to("neuron").requires_grad_()
    device_out, _ = device_layer(dx)
    assert_same(device_out.detach(), out.detach(), atol=1e-5, rtol=1e-5)
    device_out.sum().backward()
    assert_same(dx.grad, cpu_input_grad, atol=1e-5, rtol=1e-5)
    assert_same(device_layer.weight_hh_l0.grad, cpu_weight_grad, atol=1e-5, rtol=1e-5)


def test_attention_choice_works_on_fake_tensors():
    """torch.compile traces with fake tensors: choosing the attention backend reads metadata only."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(1, 4, 8, 16, device="neuron")
        k = torch.empty(1, 2, 8, 16, device="neuron")
        out = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    assert out.shape == (1, 4, 8, 16) and out.device.type == "neuron"
