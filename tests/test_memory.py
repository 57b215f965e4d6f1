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
    torch.neuron.empty_cache()  # (a cached block of the size would serve the allocation below)
    free, total = mem_get_info()
    assert total == torch.neuron.get_device_properties(0).total_memory
    held = torch.empty(1 << 16, dtype=torch.uint8, device="neuron")
    free_after, total_after = mem_get_info("neuron:0")
    assert total_after == total and free - free_after == 1 << 16
    del held


def test_torch_accelerator_memory_info_tracks_allocations():
    """PyTorch's own query (the allocator's getMemoryInfo): free is the capacity less what is reserved."""
    torch.neuron.empty_cache()
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
    assert "600000 bytes allocated (600000 reserved)" in message
    assert "capacity of 1000000 bytes" in message
    assert "OPTIMUM_NEURON_TORCH_DEVICE_MEMORY" in message
    assert info == "(100000, 1000000)"


def test_freed_blocks_are_cached_reused_and_returned_by_empty_cache():
    """As CUDA's and TorchNeuron's caching allocators: freed memory stays reserved and serves the next
    allocation of about its size (no fresh host memory, no first-touch page faults); `empty_cache()`
    returns it."""
    torch.neuron.empty_cache()
    allocated, reserved = collected_allocated(), torch.neuron.memory_reserved()
    block = torch.empty(1 << 20, dtype=torch.uint8, device="neuron")
    address = block.data_ptr()
    assert torch.neuron.memory_reserved() == reserved + (1 << 20)
    del block
    assert torch.neuron.memory_allocated() == allocated and torch.neuron.memory_reserved() == reserved + (1 << 20)
    host_allocations = torch.neuron.memory_stats()["num_device_alloc"]
    again = torch.empty((1 << 20) - 1000, dtype=torch.uint8, device="neuron")  # a little smaller: served by it
    assert again.data_ptr() == address and torch.neuron.memory_stats()["num_device_alloc"] == host_allocations
    assert torch.neuron.memory_allocated() == allocated + (1 << 20) - 1000  # what was asked for
    del again
    small = torch.empty(1 << 10, dtype=torch.uint8, device="neuron")  # far smaller: a block of its own
    assert small.data_ptr() != address and torch.neuron.memory_reserved() == reserved + (1 << 20) + (1 << 10)
    del small
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved() == reserved and torch.neuron.memory_allocated() == allocated


def test_a_model_fits_in_the_memory_the_cache_keeps():
    """The load-time check counts the blocks kept for reuse as free (it returns them first)."""
    from optimum_neuron_torch.loading.loader import check_device_memory

    torch.neuron.empty_cache()
    free, _ = mem_get_info()
    kept = torch.empty(1 << 20, dtype=torch.uint8, device="neuron")
    del kept  # cached: free memory is 1 MiB less
    assert mem_get_info()[0] == free - (1 << 20)
    with torch.device("meta"):
        model = torch.nn.Linear(1, 1, bias=False)
        model.register_buffer("rest", torch.empty(free - 4, dtype=torch.uint8))
    check_device_memory(model, torch.device("neuron:0"), "fits once the cache is returned")
    assert mem_get_info()[0] == free


def test_an_allocation_that_fits_only_without_the_cache_empties_it():
    result = run_python(
        """
        import torch, optimum_neuron_torch
        block = torch.empty(600_000, dtype=torch.uint8, device="neuron")
        del block  # cached: 600000 bytes still reserved
        assert torch.neuron.memory_reserved() == 600_000 and torch.neuron.memory_allocated() == 0
        bigger = torch.empty(900_000, dtype=torch.uint8, device="neuron")  # fits once the cache is returned
        print(torch.neuron.memory_reserved(), torch.neuron.memory_stats()["num_ooms"])
        """,
        env={"OPTIMUM_NEURON_TORCH_DEVICE_MEMORY": "1MB"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["900000", "0"]


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
