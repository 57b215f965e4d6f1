"""The `torch.neuron` module of the reference device, with TorchNeuron's public API.

Registered as `torch.neuron` when the reference device is activated. Execution is synchronous,
so streams and events are real objects whose waits return at once.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import torch

_C: Any = None  # the compiled extension, set by `bind()`


def bind(extension: Any) -> None:
    """Connects this module to the compiled extension (done once, at activation)."""
    global _C
    _C = extension


DeviceLike = torch.device | str | int | None
_PRIVATEUSE1_TYPE = 20  # c10::DeviceType::PrivateUse1


def _index(device: DeviceLike = None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "neuron":
        raise ValueError(f"expected a neuron device, got {device}")
    return current_device() if device.index is None else device.index


# ---- devices ----

def is_available() -> bool:
    return device_count() > 0


def is_initialized() -> bool:
    return _C is not None


def _lazy_init() -> None:
    """Nothing to initialize lazily: the reference runtime is ready once activated."""


def _is_in_bad_fork() -> bool:
    return False  # host memory survives fork


def device_count() -> int:
    return _C.device_count()


def current_device() -> int:
    return _C.current_device()


def set_device(device: DeviceLike) -> None:
    _C.set_current_device(_index(device))


class device:
    """Context manager that makes `device` the current neuron device."""

    def __init__(self, device: DeviceLike):
        self.index = _index(device)
        self.previous = -1

    def __enter__(self) -> None:
        self.previous = current_device()
        set_device(self.index)

    def __exit__(self, *exc: object) -> None:
        set_device(self.previous)


@dataclass(frozen=True)
class _DeviceProperties:
    name: str
    total_memory: int
    index: int


def get_device_properties(device: DeviceLike = None) -> _DeviceProperties:
    index = _index(device)
    if not 0 <= index < device_count():
        raise ValueError(f"invalid neuron device index {index}: there are {device_count()} devices")
    return _DeviceProperties(name=get_device_name(index), total_memory=_C.capacity(), index=index)


def get_device_name(device: DeviceLike = None) -> str:
    return f"Reference NeuronCore (host memory) {_index(device)}"


def get_device_capability(device: DeviceLike = None) -> dict[str, Any]:
    return {}


def synchronize(device: DeviceLike = None) -> None:
    """Execution is synchronous: nothing is ever pending."""


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


# ---- random numbers ----

def default_generator(device: DeviceLike = None) -> torch.Generator:
    return _C.default_generator(_index(device))


def manual_seed(seed: int) -> None:
    default_generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for index in range(device_count()):
        default_generator(index).manual_seed(int(seed))


def seed() -> int:
    return default_generator().seed()


def seed_all() -> None:
    chosen = default_generator(0).seed()
    for index in range(1, device_count()):
        default_generator(index).manual_seed(chosen)


def initial_seed() -> int:
    return default_generator().initial_seed()


def get_rng_state(device: DeviceLike = None) -> torch.Tensor:
    return default_generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: DeviceLike = None) -> None:
    default_generator(device).set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(index) for index in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for index, state in enumerate(new_states):
        set_rng_state(state, index)


# ---- streams and events ----

class Stream(torch.Stream):
    """A neuron stream. Work runs synchronously, so it is always complete."""

    def __new__(cls, device: DeviceLike = None, priority: int = 0, **kwargs: Any) -> "Stream":
        if "stream_id" in kwargs:
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, device=torch.device("neuron", _index(device)), priority=priority)


def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> torch.Event:
    """A neuron event (a `torch.Event`); `elapsed_time` measures host time between two records."""
    return torch.Event(device="neuron", enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


def current_stream(device: DeviceLike = None) -> torch.Stream:
    return torch.accelerator.current_stream(torch.device("neuron", _index(device)))


def default_stream(device: DeviceLike = None) -> torch.Stream:
    return torch.Stream(stream_id=0, device_index=_index(device), device_type=_PRIVATEUSE1_TYPE)


def set_stream(stream: torch.Stream) -> None:
    torch.accelerator.set_stream(stream)


@contextlib.contextmanager
def stream(stream: torch.Stream | None) -> Iterator[None]:
    """Makes `stream` current for the block."""
    if stream is None:
        yield
        return
    previous = current_stream(stream.device)
    set_stream(stream)
    try:
        yield
    finally:
        set_stream(previous)


# ---- memory ----

def memory_stats(device: DeviceLike = None) -> OrderedDict[str, Any]:
    """Allocator statistics in the format of `torch.cuda.memory_stats`."""
    return torch.accelerator.memory_stats(torch.device("neuron", _index(device)))


def memory_allocated(device: DeviceLike = None) -> int:
    return torch.accelerator.memory_allocated(torch.device("neuron", _index(device)))


def max_memory_allocated(device: DeviceLike = None) -> int:
    return torch.accelerator.max_memory_allocated(torch.device("neuron", _index(device)))


def memory_reserved(device: DeviceLike = None) -> int:
    return torch.accelerator.memory_reserved(torch.device("neuron", _index(device)))


def max_memory_reserved(device: DeviceLike = None) -> int:
    return torch.accelerator.max_memory_reserved(torch.device("neuron", _index(device)))


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    torch.accelerator.reset_peak_memory_stats(torch.device("neuron", _index(device)))


def reset_accumulated_memory_stats(device: DeviceLike = None) -> None:
    torch.accelerator.reset_accumulated_memory_stats(torch.device("neuron", _index(device)))


def empty_cache() -> None:
    """Nothing is cached: freed tensors return their memory at once."""


def mem_get_info(device: DeviceLike = None) -> tuple[int, int]:
    """(free, total) device memory in bytes."""
    return torch.accelerator.get_memory_info(torch.device("neuron", _index(device)))


def memory_summary(device: DeviceLike = None, abbreviated: bool = False) -> str:
    index = _index(device)
    stats = memory_stats(index)
    free, total = mem_get_info(index)
    rows = [
        ("allocated", stats.get("allocated_bytes.all.current", 0), stats.get("allocated_bytes.all.peak", 0)),
        ("reserved", stats.get("reserved_bytes.all.current", 0), stats.get("reserved_bytes.all.peak", 0)),
    ]
    lines = [f"neuron:{index} memory (reference device, capacity {total / 2**20:.1f} MiB, free {free / 2**20:.1f} MiB)"]
    lines += [f"  {name:<10} current {current / 2**20:10.2f} MiB   peak {peak / 2**20:10.2f} MiB" for name, current, peak in rows]
    lines.append(f"  allocations: {stats.get('allocation.all.current', 0)} live, out-of-memory errors: {stats.get('num_ooms', 0)}")
    return "\n".join(lines)


# ---- op tracking (TorchNeuron has these on `torch_neuronx`) ----

def get_fallback_ops() -> list[str]:
    """Ops that fell back to CPU since start or the last `clear_op_tracking()`."""
    return sorted(op for op, _, _ in _C.fallback_stats())


def get_executed_ops() -> list[str]:
    """Ops that ran natively since start or the last `clear_op_tracking()`."""
    return sorted(_C.executed_ops())


def clear_op_tracking() -> None:
    _C.clear_op_tracking()
