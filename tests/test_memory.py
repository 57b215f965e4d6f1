"""Device memory: capacity, statistics, out-of-memory errors, pinned host memory."""

from __future__ import annotations

import gc

import pytest
import torch

from optimum_neuron_torch.device import mem_get_info
from testing_utils import run_python


def collected_allocated() -> int:
    """Device memory in use once unreachable tensors of earlier tests are freed: a garbage collection
    triggered half-way through a test would otherwise free them under its measurements."""
    gc.collect()
    return torch.neuron.memory_allocated()


def test_allocating_and_freeing_in_a_loop_returns_memory_exactly():
    start = collected_allocated()
    for size in (1, 7, 1000, 4096, 123457):
        tensors = [torch.empty(size, device="neuron") for _ in range(3)]
        assert torch.neuron.memory_allocated() == start + 3 * 4 * size
        results = [t.fill_(1.0) * 2 for t in tensors]  # results of ops are device memory too
        assert torch.neuron.memory_allocated() == start + 6 * 4 * size
        del tensors, results
        assert torch.neuron.memory_allocated() == start


def test_peak_statistics_and_reset():
    start = collected_allocated()
    torch.neuron.reset_peak_memory_stats()
    big = torch.empty(1 << 20, dtype=torch.uint8, device="neuron")
    del big
    assert torch.neuron.max_memory_allocated() >= start + (1 << 20)
    stats = torch.neuron.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.neuron.memory_allocated()
    torch.neuron.reset_peak_memory_stats()
    assert torch.neuron.max_memory_allocated() == torch.neuron.memory_allocated()
    assert "neuron:0 memory" in torch.neuron.memory_summary()
    torch.neuron.empty_cache()


def test_mem_get_info_tracks_allocations():
    free, total = mem_get_info()
    assert total == torch.neuron.get_device_properties(0).total_memory
    held = torch.empty(1 << 16, dtype=torch.uint8, device="neuron")
    free_after, total_after = mem_get_info("neuron:0")
    assert total_after == total and free - free_after == 1 << 16
    del held


def test_torch_accelerator_memory_info_tracks_allocations():
    """PyTorch's own query (the allocator's getMemoryInfo): free is the capacity less what is allocated."""
    free, total = torch.accelerator.get_memory_info(torch.device("neuron", 0))
    assert total == torch.neuron.get_device_properties(0).total_memory
    assert free == total - torch.neuron.memory_reserved()
    held = torch.empty(1 << 16, dtype=torch.uint8, device="neuron")
    assert torch.accelerator.get_memory_info(torch.device("neuron", 0)) == (free - (1 << 16), total)
    del held


def test_out_of_memory_names_requested_allocated_and_capacity():
    result = run_python(
        """
        import torch, optimum_neuron_torch
        keep = torch.empty(600_000, dtype=torch.uint8, device="neuron")
        before = torch.neuron.memory_allocated()
        try:
            torch.empty(500_000, dtype=torch.uint8, device="neuron")
        except torch.OutOfMemoryError as error:
            print(error)
        assert torch.neuron.memory_allocated() == before
        assert torch.neuron.memory_stats()["num_ooms"] == 1
        x = torch.empty(300_000, dtype=torch.uint8, device="neuron")  # still usable after the error
        print(optimum_neuron_torch.device.mem_get_info())
        """,
        env={"OPTIMUM_NEURON_TORCH_DEVICE_MEMORY": "1MB"},
    )
    assert result.returncode == 0, result.stderr
    message, info = result.stdout.strip().splitlines()
    assert "out of memory" in message
    assert "tried to allocate 500000 bytes" in message
    assert "600000 bytes allocated" in message
    assert "capacity of 1000000 bytes" in message
    assert "OPTIMUM_NEURON_TORCH_DEVICE_MEMORY" in message
    assert info == "(100000, 1000000)"


def test_results_of_ops_count_against_capacity():
    result = run_python(
        """
        import torch, optimum_neuron_torch
        x = torch.ones(100_000, device="neuron")  # 400 kB
        y = x + 1                                  # 400 kB more
        try:
            z = y * 2                              # would exceed 1 MB
        except torch.OutOfMemoryError:
            print("oom")
        """,
        env={"OPTIMUM_NEURON_TORCH_DEVICE_MEMORY": "1MB"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "oom"


def test_bad_memory_setting_is_a_clear_error():
    result = run_python("import optimum_neuron_torch", env={"OPTIMUM_NEURON_TORCH_DEVICE_MEMORY": "lots"})
    assert result.returncode != 0
    assert "OPTIMUM_NEURON_TORCH_DEVICE_MEMORY='lots' is not a size" in result.stderr


def test_pinned_memory():
    host = torch.randn(16)
    pinned = host.pin_memory()
    assert pinned.is_pinned() and not host.is_pinned()
    assert pinned.device.type == "cpu"
    assert torch.equal(pinned.to("neuron", non_blocking=True).cpu(), host)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_copies_between_host_and_device_keep_values(dtype):
    host = (torch.randn(5, 7) * 10).to(dtype)
    device = host.to("neuron")
    assert device.dtype == dtype
    assert torch.equal(device.cpu(), host)
    assert torch.equal(device.t().contiguous().cpu(), host.t().contiguous())
    assert torch.equal(device.to(torch.float32).cpu(), host.to(torch.float32))
