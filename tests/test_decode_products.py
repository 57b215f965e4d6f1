"""The reference device's kernel for decode products: a few rows times a large [out, in] weight.

`x @ W.t()` with at most 8 rows and a weight of at least 2**16 elements (csrc/matmul.cpp) runs a
kernel that reads each weight row once; every other product runs the CPU kernel. Checked against
float64 on the CPU, at the boundaries of what takes the kernel.
"""

from __future__ import annotations

import pytest
import torch

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
