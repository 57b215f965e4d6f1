"""Random numbers on `neuron`, as TorchNeuron draws them. Its random ops take the CPU fallback
(PyTorch's `cpu_fallback`, generator arguments untouched), so they draw from the CPU default
generator; its dropout draws the mask on the host from that generator too (`python_ops/torch_mlir/
ops/dropout.py`); the `neuron` generator holds a state (seed and offset, 16 bytes) that no op reads
(TorchNeuron's own `test_neuron_tensor_generation_independent_from_cpu` is an expected failure for
this reason). So `torch.manual_seed` is what makes a run repeat, on Trn as here."""

from __future__ import annotations

import pytest
import torch


def draw(device: str = "neuron") -> torch.Tensor:
    return torch.cat([torch.randn(8, device=device), torch.rand(8, device=device),
                      torch.randint(0, 100, (8,), device=device).float()]).cpu()


def test_draws_are_the_cpu_generator_s_and_torch_manual_seed_repeats_them():
    torch.manual_seed(5)
    first = draw()
    torch.manual_seed(5)
    assert torch.equal(draw("cpu"), first)  # the very numbers the CPU draws
    torch.manual_seed(5)
    torch.neuron.manual_seed(99)  # (the neuron seed changes nothing)
    assert torch.equal(draw(), first)
    torch.manual_seed(6)
    assert not torch.equal(draw(), first)


def test_the_neuron_generator_state_is_torchneuron_s_and_round_trips():
    torch.neuron.manual_seed(77)
    state = torch.neuron.get_rng_state()
    assert state.dtype == torch.uint8 and state.numel() == 16
    assert state[:8].view(torch.int64).item() == 77 and state[8:].view(torch.int64).item() == 0
    moved = state.clone()
    moved[8:] = torch.tensor([400], dtype=torch.int64).view(torch.uint8)
    torch.neuron.set_rng_state(moved)  # (DTensor's random ops move the offset so)
    assert torch.equal(torch.neuron.get_rng_state(), moved)
    draw()
    assert torch.equal(torch.neuron.get_rng_state(), moved)  # no op reads or moves it
    torch.neuron.set_rng_state(state)
    assert torch.neuron.initial_seed() == 77
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch.neuron.set_rng_state(torch.zeros(5056, dtype=torch.uint8))


def test_a_neuron_generator_is_refused_by_random_ops_as_on_torchneuron():
    generator = torch.Generator(device="neuron")
    assert generator.device == torch.device("neuron", 0)
    generator.manual_seed(11)
    assert generator.initial_seed() == 11
    with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator"):
        torch.randn(16, device="neuron", generator=generator)


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_dropout_draws_torchneuron_s_masks(p):
    x = torch.randn(64, 8)
    torch.manual_seed(3)
    output, mask = torch.native_dropout(x.to("neuron"), p, True)
    torch.manual_seed(3)
    if 0.0 < p < 1.0:
        expected = torch.bernoulli(torch.empty(64, 8, dtype=torch.bool), 1.0 - p)
    else:
        expected = torch.full((64, 8), p == 0.0)
    assert mask.dtype == torch.bool and torch.equal(mask.cpu(), expected)
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    assert torch.equal(output.cpu(), x * expected.to(x.dtype) * scale)
    if 0.0 < p < 1.0:  # (functional dropout takes this kernel for these only)
        torch.manual_seed(3)
        torch.neuron.manual_seed(4)
        assert torch.equal(torch.nn.functional.dropout(x.to("neuron"), p, training=True).cpu(), output.cpu())
