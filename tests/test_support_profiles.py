"""The support profile: ops outside TorchNeuron's native set take a counted fallback path."""

from __future__ import annotations

import warnings

import pytest
import torch

from optimum_neuron_torch.device import clear_op_tracking, executed_ops, fallback_ops, reference
from optimum_neuron_torch.errors import ConfigurationError
from testing_utils import assert_same, run_python


def test_fallbacks_are_counted_exactly(fallback_mode):
    fallback_mode("silent")
    x = torch.randn(4, 5, device="neuron")
    clear_op_tracking()
    for _ in range(3):
        x.argmax(dim=1)  # aten::argmax.out is not native on TorchNeuron
    y = x + x  # add.Tensor is native
    stats = reference.fallback_counts()
    assert stats["aten::argmax.out"][0] == 3
    assert stats["aten::argmax.out"][1] > 0
    assert fallback_ops() == ["aten::argmax.out"]
    assert "aten::add.Tensor" in executed_ops()
    assert "aten::argmax.out" not in executed_ops()
    assert_same(y, x.cpu() * 2)
    clear_op_tracking()
    assert fallback_ops() == [] and reference.fallback_counts() == {}


def test_fallback_warns_once_per_op_in_torchneuron_words(fallback_mode):
    fallback_mode("warn")
    x = torch.randn(4, 5, device="neuron")
    clear_op_tracking()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x.argmax()
        x.argmax()
        x.cumprod(0)
    messages = [str(w.message) for w in caught]
    assert sum("Operator 'aten::argmax.out' fell back to CPU" in m for m in messages) == 1
    assert sum("Operator 'aten::cumprod.out' fell back to CPU" in m for m in messages) == 1


def test_strict_mode_raises_naming_op_and_setting(fallback_mode):
    x = torch.randn(4, 5, device="neuron")
    fallback_mode("error")
    with pytest.raises(NotImplementedError,
                       match="Operator 'aten::argmax.out' fell back to CPU.*OPTIMUM_NEURON_TORCH_FALLBACK=error"):
        x.argmax()
    x + x  # native ops still run


def test_strict_mode_from_the_environment():
    result = run_python(
        """
        import torch, optimum_neuron_torch
        x = torch.ones(3, device="neuron")
        print((x * 2).sum().item())
        try:
            x.argmax()
        except NotImplementedError as error:
            print("refused", "aten::argmax.out" in str(error))
        """,
        env={"OPTIMUM_NEURON_TORCH_FALLBACK": "error"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["6.0", "refused", "True"]


def test_full_profile_has_no_fallbacks(profile, fallback_mode):
    fallback_mode("error")
    profile("full")
    x = torch.randn(4, 5, device="neuron")
    clear_op_tracking()
    x.argmax().item()
    assert fallback_ops() == []
    assert "aten::argmax.out" in executed_ops()


def test_view_ops_never_count_as_fallbacks(profile, fallback_mode):
    fallback_mode("silent")
    profile("torchneuron")
    x = torch.randn(4, 6, device="neuron")
    clear_op_tracking()
    x.view(6, 4).t().unfold(0, 2, 1)
    torch.view_as_real(torch.zeros(2, dtype=torch.complex64, device="neuron"))
    assert fallback_ops() == []


def test_a_user_supplied_op_list_replaces_the_shipped_one(tmp_path, profile, fallback_mode):
    fallback_mode("silent")
    op_list = tmp_path / "ops.txt"
    op_list.write_text("# dumped on a Trn instance\naten::argmax.out\n")
    profile(str(op_list))
    x = torch.randn(3, 3, device="neuron")
    clear_op_tracking()
    x.argmax()
    x + x
    assert executed_ops() == ["aten::argmax.out"]
    assert fallback_ops() == ["aten::add.Tensor"]


def test_bad_op_list_names_file_and_line(tmp_path):
    op_list = tmp_path / "ops.txt"
    op_list.write_text("aten::add.out\nnot an op\n")
    with pytest.raises(ConfigurationError, match=r"ops.txt, line 2: 'not an op' is not an op name"):
        reference.set_profile(str(op_list))
    with pytest.raises(ConfigurationError, match="unknown support profile 'nope'"):
        reference.set_profile("nope")


def test_shipped_op_list_keeps_its_provenance():
    from importlib import resources

    text = resources.files("optimum_neuron_torch.device.reference").joinpath("torchneuron_native_ops.txt").read_text()
    assert text.startswith("# TorchNeuron")
    assert "Source:" in text
    ops = reference.profiles.shipped_op_list()
    assert len(ops) == 365 and "aten::add.out" in ops and "aten::argmax" not in ops


@pytest.mark.parametrize("copies", [False, True])
def test_copying_fallback_gives_the_same_results(copies, fallback_mode):
    fallback_mode("silent")
    reference.set_fallback_copies(copies)
    try:
        x = torch.randn(6, 5)
        d = x.to("neuron")
        assert_same(d.cumprod(1), x.cumprod(1))
        assert_same(d.argmax(1), x.argmax(1))
        out = torch.empty(0, device="neuron")
        torch.cumprod(d, 0, out=out)  # out= resized on the fallback path
        assert_same(out, x.cumprod(0))
        y = d.clone()
        y.t().cumprod_(0)  # in place through a view, on the fallback path
        z = x.clone()
        z.t().cumprod_(0)
        assert_same(y, z)
        values, indices = d.sort(dim=1)
        assert_same(values, x.sort(dim=1).values)
    finally:
        reference.set_fallback_copies(False)
