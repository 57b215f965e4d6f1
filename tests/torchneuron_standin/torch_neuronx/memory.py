"""TorchNeuron's memory API (`torch_neuronx.memory`), read from the reference device's allocator.

The statistics keep TorchNeuron's own format, not CUDA's flat one: `memory_stats()` is a dict of
per-kind dicts (`stats["allocated_bytes"]["current"]`...), so code written against
`torch.cuda.memory_stats()` keys fails here as it would on Trainium. None of these start the runtime.
"""

from __future__ import annotations

from typing import Any

import torch


def _get_device_index(device: int | str | torch.device | None = None) -> int:
    """Device index, defaulting to the current device."""
    import torch_neuronx

    if device is None:
        return torch_neuronx.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return torch_neuronx.current_device() if device.index is None else device.index


def _stat(flat: dict[str, int], kind: str) -> dict[str, int]:
    return {field: int(flat.get(f"{kind}.all.{field}", 0)) for field in ("current", "peak", "allocated", "freed")}


def memory_stats(device: int | torch.device | None = None) -> dict[str, Any]:
    """Allocator statistics of a device, in TorchNeuron's format."""
    flat = torch.accelerator.memory_stats(torch.device("neuron", _get_device_index(device)))
    return {
        "allocated_bytes": _stat(flat, "allocated_bytes"),
        # TorchNeuron never updates it (csrc/core/metrics/NeuronMetrics.h: "currently always 0, no caching")
        "reserved_bytes": {field: 0 for field in ("current", "peak", "allocated", "freed")},
        "active_bytes": _stat(flat, "active_bytes"),
        "num_alloc_retries": int(flat.get("num_alloc_retries", 0)),
        "num_ooms": int(flat.get("num_ooms", 0)),
        "num_tensor_frees": int(flat.get("num_device_free", 0)),
        "allocation_requests": int(flat.get("num_device_alloc", 0)),
    }


def memory_allocated(device: int | torch.device | None = None) -> int:
    """Bytes currently held by tensors."""
    return memory_stats(device)["allocated_bytes"]["current"]


def max_memory_allocated(device: int | torch.device | None = None) -> int:
    """Peak of `memory_allocated` since the last reset."""
    return memory_stats(device)["allocated_bytes"]["peak"]


def memory_reserved(device: int | torch.device | None = None) -> int:
    """Bytes held in the cache: always 0, as TorchNeuron's (memory.py: "caching is not implemented")."""
    return memory_stats(device)["reserved_bytes"]["current"]


def max_memory_reserved(device: int | torch.device | None = None) -> int:
    """Peak of `memory_reserved` since the last reset."""
    return memory_stats(device)["reserved_bytes"]["peak"]


def reset_peak_memory_stats(device: int | torch.device | None = None) -> None:
    """Restarts the peaks from the current values."""
    torch.accelerator.reset_peak_memory_stats(torch.device("neuron", _get_device_index(device)))


def reset_accumulated_memory_stats(device: int | torch.device | None = None) -> None:
    """Resets the counters (allocations, frees, out-of-memory errors)."""
    torch.accelerator.reset_accumulated_memory_stats(torch.device("neuron", _get_device_index(device)))


def memory_summary(device: int | torch.device | None = None, abbreviated: bool = False) -> str:
    """A table of the statistics, laid out like TorchNeuron's."""
    index = _get_device_index(device)
    stats = memory_stats(index)

    def size(value: float) -> str:
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(value) < 1024:
                return f"{value:,.0f} {unit}"
            value /= 1024
        return f"{value:,.0f} PiB"

    rule = "=" * 75
    lines = [
        rule,
        f"  Neuron Memory Summary, Device {index}",
        rule,
        f"  Allocations: {stats['allocation_requests']:,}  |  Frees: {stats['num_tensor_frees']:,}",
        f"  OOMs: {stats['num_ooms']:,}  |  Alloc Retries: {stats['num_alloc_retries']:,}",
        rule,
        "  Metric              | Current    | Peak       | Allocated  | Freed",
        "-" * 75,
    ]
    for name, key in (("Allocated Memory", "allocated_bytes"), ("Reserved Memory", "reserved_bytes"),
                      ("Active Memory", "active_bytes")):
        s = stats[key]
        lines.append(
            f"  {name:<18} | {size(s['current']):>10} | {size(s['peak']):>10} "
            f"| {size(s['allocated']):>10} | {size(s['freed']):>10}"
        )
    lines.append(rule)
    return "\n".join(lines)
