"""Random numbers on the device: reproducible, and independent of the CPU generator."""

from __future__ import annotations

import torch


def draw() -> torch.Tensor:
    return torch.cat([torch.randn(8, device="neuron"), torch.rand(8, device="neuron"),
                      torch.randint(0, 100, (8,), device="neuron").float()]).cpu()


def test_manual_seed_reproduces_draws():
    torch.neuron.manual_seed(1234)
    first = draw()
    torch.neuron.manual_seed(1234)
    assert torch.equal(draw(), first)
    torch.neuron.manual_seed(4321)
    assert not torch.equal(draw(), first)


def test_torch_manual_seed_also_seeds_the_device():
    torch.manual_seed(7)
    first = draw()
    torch.manual_seed(7)
    assert torch.equal(draw(), first)


def test_device_generator_is_separate_from_the_cpu_one():
    torch.neuron.manual_seed(5)
    torch.randn(100)  # CPU draws do not move the device generator
    a = draw()
    torch.neuron.manual_seed(5)
    assert torch.equal(draw(), a)


def test_rng_state_round_trip():
    torch.neuron.manual_seed(0)
    state = torch.neuron.get_rng_state()
    a = draw()
    torch.neuron.set_rng_state(state)
    assert torch.equal(draw(), a)
    assert torch.neuron.initial_seed() == 0


def test_explicit_generators():
    gen = torch.Generator(device="neuron")
    assert gen.device == torch.device("neuron", 0)
    gen.manual_seed(11)
    a = torch.randn(16, device="neuron", generator=gen).cpu()
    gen.manual_seed(11)
    b = torch.randn(16, device="neuron", generator=gen).cpu()
    assert torch.equal(a, b)
    x = torch.empty(1000, device="neuron").uniform_(2.0, 3.0, generator=gen).cpu()
    assert x.min() >= 2.0 and x.max() <= 3.0
    probs = torch.tensor([0.0, 0.0, 1.0], device="neuron")
    assert torch.multinomial(probs, 4, replacement=True, generator=gen).cpu().tolist() == [2, 2, 2, 2]


def test_dropout_is_reproducible_under_seed():
    x = torch.ones(64, device="neuron")
    torch.neuron.manual_seed(3)
    a = torch.nn.functional.dropout(x, 0.5, training=True).cpu()
    torch.neuron.manual_seed(3)
    b = torch.nn.functional.dropout(x, 0.5, training=True).cpu()
    assert torch.equal(a, b) and set(a.unique().tolist()) <= {0.0, 2.0}
