"""The reference device's decode kernels, checked against float64 on the CPU at the boundaries of
what takes them.

- Products of a few rows and a large [out, in] weight: `x @ W.t()` with at most 8 rows and a weight
  of at least 2**16 elements (csrc/matmul.cpp) reads each weight row once; other products run the
  CPU kernel.
- Attention of at most 8 query rows over at least 128 keys (csrc/decode_attention.cpp); other
  attention runs the CPU flash kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import optimum_neuron_torch  # noqa: F401  (the `neuron` device)

TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=5e-2)}


def operands(rows: int, outputs: int, width: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator).to(dtype)
    weight = torch.randn(outputs, width, generator=generator).to(dtype)
    return x, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("outputs, width", [(576, 576), (49152, 24), (130, 1009), (7, 16)])
def test_products_equal_the_float64_product(dtype, rows, outputs, width):
    # Widths that are not a multiple of 16 (1009, 24) have a tail; (7, 16) is under the size of the kernel.
    x, weight = operands(rows, outputs, width, dtype)
    expected = (x.double() @ weight.double().t()).to(dtype)
    product = x.to("neuron") @ weight.to("neuron").t()
    assert product.device.type == "neuron" and product.dtype == dtype and product.shape == (rows, outputs)
    torch.testing.assert_close(product.cpu(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_does_not_depend_on_the_other_rows(dtype):
    """Batching never changes a sequence's numbers: each row is summed in one order for 1 to 8 rows."""
    x, weight = operands(8, 300, 1000, dtype)
    device_x, device_weight = x.to("neuron"), weight.to("neuron")
    alone = torch.cat([(device_x[i:i + 1] @ device_weight.t()).cpu() for i in range(8)])
    for rows in (2, 4, 5, 8):
        together = (device_x[:rows] @ device_weight.t()).cpu()
        assert torch.equal(together, alone[:rows]), f"{rows} rows"


def test_linear_and_mm_out_write_the_product():
    x, weight = operands(4, 576, 576, torch.float32)
    expected = x.double() @ weight.double().t()
    device_x, device_weight = x.to("neuron"), weight.to("neuron")
    out = torch.full((4, 576), float("nan"), device="neuron")
    result = torch.mm(device_x, device_weight.t(), out=out)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-4)
    # F.linear of a [batch, 1, hidden] decode activation reaches mm through matmul.
    linear = torch.nn.functional.linear(device_x.unsqueeze(1), device_weight)
    torch.testing.assert_close(linear.cpu().double().squeeze(1), expected, rtol=1e-5, atol=1e-4)


def test_products_the_kernel_does_not_take_still_compute():
    x, weight = operands(2, 576, 576, torch.float32)
    expected = x.double() @ weight.double().t()
    device_x, device_weight = x.to("neuron"), weight.to("neuron")
    cases = {
        "[in, out] weight": lambda: device_x @ weight.t().contiguous().to("neuron"),
        "strided rows": lambda: torch.stack([x, x], dim=2).to("neuron")[..., 0] @ device_weight.t(),
        "an out= of another shape (resized)": lambda: torch.mm(device_x, device_weight.t(),
                                                               out=torch.empty(0, device="neuron")),
        "an out= that is not contiguous": lambda: torch.mm(
            device_x, device_weight.t(), out=torch.empty(576, 2, device="neuron").t()),
    }
    for name, product in cases.items():
        torch.testing.assert_close(product().cpu().double(), expected, rtol=1e-5, atol=1e-4, msg=name)


def test_the_decode_product_runs_under_the_strict_fallback_policy():
    """mm is native on TorchNeuron: the kernel counts as native, not as a fallback."""
    x, weight = operands(1, 576, 576, torch.float32)
    with optimum_neuron_torch.fallback_policy("error"):
        product = x.to("neuron") @ weight.to("neuron").t()
    torch.testing.assert_close(product.cpu().double(), x.double() @ weight.double().t(), rtol=1e-5, atol=1e-4)


def attention_inputs(batch, heads, kv_heads, rows, keys, head_dim, dtype, mask_kind, seed=0):
    """Query laid out as Transformers makes it ([batch, rows, heads, dim] transposed), and a mask."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, rows, heads, head_dim, generator=generator).to(dtype).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, keys, head_dim, generator=generator).to(dtype) for _ in range(2))
    mask = None
    if mask_kind == "bool":  # per sequence, broadcast over heads; the first row sees nothing
        mask = torch.rand(batch, 1, rows, keys, generator=generator) > 0.3
        mask[0, 0, 0] = False
    elif mask_kind == "additive":  # Transformers' padding mask: finfo.min where masked, shared by the batch
        mask = torch.where(torch.rand(1, 1, rows, keys, generator=generator) > 0.3, 0.0,
                           torch.finfo(dtype).min).to(dtype)
    elif mask_kind == "-inf":  # full shape, half the keys masked, the last row of the last head fully
        mask = torch.zeros(batch, heads, rows, keys, dtype=dtype)
        mask[..., keys // 2:] = float("-inf")
        mask[-1, -1, -1] = float("-inf")
    return query, key, value, mask


def float64_attention(query, key, value, mask):
    """The exact attention; a fully masked row is 0, as the CPU kernel makes it."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    exact = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), attn_mask=mask,
                                           enable_gqa=True)
    return exact.nan_to_num(0.0)


def on_device(*tensors):
    return [None if tensor is None else tensor.to("neuron") for tensor in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive", "-inf"])
@pytest.mark.parametrize("shape", [(2, 9, 3, 1, 128, 64), (1, 4, 4, 5, 300, 24), (3, 8, 2, 8, 1000, 72),
                                   (2, 6, 2, 16, 203, 20)],
                         ids=["decode-gqa", "5-rows-dim-24", "8-rows-dim-72", "16-rows-dim-20"])
def test_decode_attention_equals_the_float64_attention(dtype, mask_kind, shape):
    query, key, value, mask = attention_inputs(*shape, dtype, mask_kind)
    expected = float64_attention(query, key, value, mask)
    cpu = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    output = F.scaled_dot_product_attention(*on_device(query, key, value), attn_mask=on_device(mask)[0],
                                            enable_gqa=True)
    assert output.stride() == cpu.stride()  # laid out like the query, as the meta function says
    # As close to the exact attention as the CPU kernel is (bfloat16: it rounds the weights, this kernel does not).
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=4e-3)
    torch.testing.assert_close(output.cpu().double(), expected, **tolerance)
    torch.testing.assert_close(cpu.double().nan_to_num(0.0), expected, **tolerance)


def test_decode_attention_returns_the_cpu_kernels_logsumexp_and_its_gradients_follow():
    """The logsumexp feeds the backward pass: decode-shaped attention trains as on the CPU."""
    query, key, value, allowed = attention_inputs(2, 4, 2, 3, 160, 32, torch.float32, "bool")
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))  # (the CPU kernel takes no bool mask)
    key, value = key.repeat_interleave(2, 1), value.repeat_interleave(2, 1)  # the fused op takes equal heads
    fused = torch.ops.aten._scaled_dot_product_fused_attention_overrideable
    output, logsumexp = fused(*on_device(query, key, value), on_device(mask)[0])[:2]
    cpu_output, cpu_logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=mask)
    torch.testing.assert_close(output.cpu(), cpu_output, rtol=1e-5, atol=1e-5)
    assert logsumexp.dtype == torch.float32 and logsumexp.shape == (2, 4, 3)
    torch.testing.assert_close(logsumexp.cpu(), cpu_logsumexp, rtol=1e-5, atol=1e-5)  # fully masked row: 0

    def gradients(device):
        leaves = [tensor.detach().to(device).requires_grad_() for tensor in (query, key, value)]
        attended = F.scaled_dot_product_attention(*leaves, attn_mask=mask.to(device))
        (attended * torch.arange(attended.numel(), device=device).reshape(attended.shape).sin()).sum().backward()
        return [leaf.grad.cpu() for leaf in leaves]

    for device_grad, cpu_grad in zip(gradients("neuron"), gradients("cpu"), strict=True):
        torch.testing.assert_close(device_grad, cpu_grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["127 keys", "65 query rows", "causal"])
def test_attention_the_decode_kernel_does_not_take_is_the_cpu_kernels(case):
    rows, keys = {"127 keys": (1, 127), "65 query rows": (65, 200), "causal": (4, 200)}[case]
    query, key, value, _ = attention_inputs(1, 4, 4, rows, keys, 32, torch.float32, None)
    causal = case == "causal"
    cpu = F.scaled_dot_product_attention(query, key, value, is_causal=causal)
    output = F.scaled_dot_product_attention(*on_device(query, key, value), is_causal=causal)
    assert torch.equal(output.cpu(), cpu)  # the same kernel, bit for bit


@pytest.mark.parametrize("position", [3, 197], ids=["in a block of 8 keys", "in the last keys"])
def test_a_nan_key_makes_the_rows_that_read_its_head_nan_as_on_the_cpu(position):
    """SDPA hands the kernels a bool mask as an additive one (-inf where hidden), and NaN + -inf is NaN:
    every row that reads the NaN key's head is NaN (TorchNeuron's decomposition adds it too), even one
    that attends that key only, or one whose mask hides it; the other head's rows are numbers."""
    query, key, value, allowed = attention_inputs(1, 4, 2, 3, 200, 32, torch.float32, "bool")
    key[0, 1, position] = float("nan")  # (read by query heads 2 and 3)
    allowed[..., position] = True  # (row 0 attends that key only)
    allowed[0, 0, 2, position] = False
    cpu = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, enable_gqa=True)
    output = F.scaled_dot_product_attention(*on_device(query, key, value), attn_mask=on_device(allowed)[0],
                                            enable_gqa=True).cpu()
    expected = torch.zeros(1, 4, 3, dtype=torch.bool)
    expected[0, 2:] = True
    assert torch.equal(cpu.isnan().all(-1), expected) and torch.equal(cpu.isnan().any(-1), expected)
    assert torch.equal(output.isnan().all(-1), expected) and torch.equal(output.isnan().any(-1), expected)
