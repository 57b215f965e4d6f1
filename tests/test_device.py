"""The `neuron` device and the `torch.neuron` module."""

from __future__ import annotations

import threading

import pytest
import torch

import optimum_neuron_torch
from testing_utils import run_python


def test_seed_example_runs_verbatim(capsys):
    model = torch.nn.Linear(10, 1).to("neuron")
    x = torch.randn(2, 10).to("neuron")
    print(model(x))
    out = capsys.readouterr().out
    assert "device='neuron:0'" in out
    expected = torch.nn.functional.linear(x.cpu(), model.weight.cpu(), model.bias.cpu())
    torch.testing.assert_close(model(x).cpu(), expected)


def test_tensors_and_modules_move_to_the_device():
    t = torch.randn(3, 4, device="neuron")
    assert t.device == torch.device("neuron", 0)
    assert t.is_neuron
    module = torch.nn.Linear(4, 2).neuron()
    assert all(p.device.type == "neuron" and isinstance(p, torch.nn.Parameter) for p in module.parameters())
    assert torch.equal(t.cpu().to("neuron").cpu(), t.cpu())


def test_backend_info_reports_the_reference_device():
    info = optimum_neuron_torch.backend_info()
    assert info.name == "reference"
    assert info.version == optimum_neuron_torch.__version__
    assert info.profile == "torchneuron"
    assert info.device_count == torch.neuron.device_count() == 1
    assert "reference" in str(info)


def test_backend_info_stays_current_after_the_policy_or_profile_changes():
    info = optimum_neuron_torch.backend_info()
    assert info.fallback == optimum_neuron_torch.get_fallback_policy() == "warn"
    with optimum_neuron_torch.fallback_policy("silent"):
        assert info.fallback == "silent" and "fallback silent" in str(optimum_neuron_torch.backend_info())
        with optimum_neuron_torch.device.support_profile("full"):
            assert info.profile == "full" and "profile full" in str(info)
    assert (info.fallback, info.profile) == ("warn", "torchneuron")


def test_torch_accelerator_reports_the_device():
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator() == torch.device("neuron")
    assert torch.accelerator.device_count() == 1
    assert torch.device(0).type == "neuron"


def test_device_properties_and_selection():
    assert torch.neuron.is_available()
    assert torch.neuron.current_device() == 0
    props = torch.neuron.get_device_properties(0)
    assert props.total_memory == optimum_neuron_torch.device.mem_get_info()[1]
    assert torch.neuron.get_device_name() == "neuron:0" == torch.neuron.get_device_name(torch.device("neuron:0"))
    assert torch.neuron.is_bf16_supported()
    with pytest.raises(RuntimeError, match="invalid device index 3"):
        torch.neuron.set_device(3)


def test_several_devices_when_configured():
    result = run_python(
        """
        import torch, optimum_neuron_torch
        assert torch.neuron.device_count() == 3
        with torch.neuron.device(2):
            t = torch.ones(4, device="neuron")
            assert torch.neuron.current_device() == 2
        assert t.device == torch.device("neuron", 2)
        assert torch.neuron.current_device() == 0
        u = (t * 2).to("neuron:1")
        assert u.device.index == 1 and u.cpu().tolist() == [2.0] * 4
        assert torch.neuron.memory_allocated(2) == 16 and torch.neuron.memory_allocated(1) == 16
        print("ok")
        """,
        env={"OPTIMUM_NEURON_TORCH_DEVICE_COUNT": "3"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_reference_device_counts_what_crosses_between_host_and_device():
    from optimum_neuron_torch.device import reference

    reference.clear_transfer_counts()
    x = torch.arange(10, dtype=torch.float32).to("neuron")  # 40 bytes to the device
    y = (x * 2).clone()  # on the device: nothing crosses
    assert y.cpu().tolist() == [2.0 * i for i in range(10)]  # 40 bytes back, and the host waited
    assert y[3].item() == 6.0  # 4 bytes, a wait
    assert reference.transfer_counts() == {"host_to_device_bytes": 40, "host_to_device_copies": 1,
                                           "device_to_host_bytes": 44, "synchronizations": 2}
    reference.clear_transfer_counts()
    assert set(reference.transfer_counts().values()) == {0}


def test_streams_and_events():
    stream = torch.neuron.Stream()
    assert stream.device == torch.device("neuron", 0)
    assert torch.neuron.current_stream().stream_id == torch.neuron.default_stream().stream_id == 0
    with torch.neuron.stream(stream):
        assert torch.neuron.current_stream() == stream
    assert torch.neuron.current_stream() != stream
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    x = torch.ones(256, 256, device="neuron")
    (x @ x).sum().item()
    end.record()
    end.synchronize()
    assert start.query() and end.query()
    assert start.elapsed_time(end) > 0
    torch.neuron.synchronize()
    stream.synchronize()


def test_amp_dtypes():
    assert torch.bfloat16 in torch.neuron.get_amp_supported_dtype()
    # torch's default for a PrivateUse1 device, as TorchNeuron leaves it, in this thread and any other
    assert torch.get_autocast_dtype("neuron") == torch.float16
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_autocast_dtype("neuron")))
    thread.start()
    thread.join()
    assert seen == [torch.float16]
