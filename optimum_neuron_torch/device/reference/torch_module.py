"""The `_torch.neuron` module of the reference device: TorchNeuron's public functions, and no others.

Registered as `_torch.neuron` when the reference device is activated. Its public names are exactly
those of TorchNeuron's `_torch.neuron` (tests compare the lists): a function that existed only here
would let code pass on any machine and fail on Trainium. What the library needs beyond them lives in
`optimum_neuron_torch.device`. Execution is synchronous, so streams and events are real objects
whose waits return at once. Names imported for the implementation are private (`_torch`...).
"""


import contextlib as _contextlib
from collections import OrderedDict as _OrderedDict
from collections.abc import Iterator as _Iterator
from dataclasses import dataclass as _dataclass
from typing import Any as _Any

import torch as _torch

_C: _Any = None  # the compiled extension, set by `bind()`


def _bind(extension: _Any) -> None:
    """Connects this module to the compiled extension (done once, at activation)."""
    global _C
    _C = extension


_DeviceLike = _torch.device | str | int | None
_PRIVATEUSE1_TYPE = 20  # c10::DeviceType::PrivateUse1


def _index(device: _DeviceLike = None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = _torch.device(device)
    if device.type != "neuron":
        raise ValueError(f"expected a neuron device, got {device}")
    return current_device() if device.index is None else device.index


# ---- devices ----

def is_available() -> bool:
    return device_count() > 0


def is_initialized() -> bool:
    return _C is not None


def init() -> None:
    """Nothing to start: the reference runtime is ready once activated (TorchNeuron starts its runtime here)."""


def _lazy_init() -> None:
    """Nothing to initialize lazily: the reference runtime is ready once activated."""


def _is_in_bad_fork() -> bool:
    return False  # host memory survives fork


def device_count() -> int:
    return _C.device_count()


def current_device() -> int:
    return _C.current_device()


def set_device(device: _DeviceLike) -> None:
    _C.set_current_device(_index(device))


class device:
    """Context manager that makes `device` the current neuron device."""

    def __init__(self, device: _DeviceLike):
        self.index = _index(device)
        self.previous = -1

    def __enter__(self) -> None:
        self.previous = current_device()
        set_device(self.index)

    def __exit__(self, *exc: object) -> None:
        set_device(self.previous)


@_dataclass(frozen=True)
class _DeviceProperties:
    name: str
    total_memory: int
    index: int


def get_device_properties(device: _DeviceLike = None) -> _DeviceProperties:
    index = _index(device)
    if not 0 <= index < device_count():
        raise ValueError(f"invalid neuron device index {index}: there are {device_count()} devices")
    return _DeviceProperties(name=get_device_name(index), total_memory=_C.capacity(), index=index)


def get_device_name(device: _DeviceLike = 0) -> str:
    """`"neuron:<index>"`, as TorchNeuron names its devices."""
    return f"neuron:{_index(device)}"


def synchronize(device: _DeviceLike = None) -> None:
    """Execution is synchronous: nothing is ever pending."""


def is_bf16_supported() -> bool:
    return True


def get_amp_supported_dtype() -> list[_torch.dtype]:
    return [_torch.float32, _torch.float16, _torch.bfloat16]


# ---- random numbers ----

def _default_generator(device: _DeviceLike = None) -> _torch.Generator:
    return _C.default_generator(_index(device))


def manual_seed(seed: int) -> None:
    _default_generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for index in range(device_count()):
        _default_generator(index).manual_seed(int(seed))


def seed() -> int:
    return _default_generator().seed()


def seed_all() -> None:
    chosen = _default_generator(0).seed()
    for index in range(1, device_count()):
        _default_generator(index).manual_seed(chosen)


def initial_seed() -> int:
    return _default_generator().initial_seed()


def get_rng_state(device: _DeviceLike = None) -> _torch.Tensor:
    return _default_generator(device).get_state()


def set_rng_state(new_state: _torch.Tensor, device: _DeviceLike = None) -> None:
    _default_generator(device).set_state(new_state)


# ---- streams and events ----

class Stream(_torch.Stream):
    """A neuron stream. Work runs synchronously, so it is always complete."""

    def __new__(cls, device: _DeviceLike = None, priority: int = 0, **kwargs: _Any) -> "Stream":
        if "stream_id" in kwargs:
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, device=_torch.device("neuron", _index(device)), priority=priority)


def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> _torch.Event:
    """A neuron event (a `_torch.Event`); `elapsed_time` measures host time between two records."""
    return _torch.Event(device="neuron", enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


def current_stream(device: _DeviceLike = None) -> _torch.Stream:
    return _torch.accelerator.current_stream(_torch.device("neuron", _index(device)))


def default_stream(device: _DeviceLike = None) -> _torch.Stream:
    return _torch.Stream(stream_id=0, device_index=_index(device), device_type=_PRIVATEUSE1_TYPE)


def set_stream(stream: _torch.Stream) -> None:
    _torch.accelerator.set_stream(stream)


def wait_stream(stream: _torch.Stream) -> None:
    """Makes the current stream wait for `stream`: work is synchronous, so it has finished."""
    current_stream().wait_stream(stream)


def wait_event(event: _torch.Event) -> None:
    current_stream().wait_event(event)


def record_event(event: _torch.Event | None = None) -> _torch.Event:
    return current_stream().record_event(event)


def query() -> bool:
    """Whether the current stream's work is done (always, on the synchronous reference device)."""
    return current_stream().query()


@_contextlib.contextmanager
def stream(stream: _torch.Stream | None) -> _Iterator[None]:
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

def memory_stats(device: _DeviceLike = None) -> _OrderedDict[str, _Any]:
    """Allocator statistics in the format of `_torch.cuda.memory_stats`."""
    return _torch.accelerator.memory_stats(_torch.device("neuron", _index(device)))


def memory_allocated(device: _DeviceLike = None) -> int:
    return _torch.accelerator.memory_allocated(_torch.device("neuron", _index(device)))


def max_memory_allocated(device: _DeviceLike = None) -> int:
    return _torch.accelerator.max_memory_allocated(_torch.device("neuron", _index(device)))


def memory_reserved(device: _DeviceLike = None) -> int:
    return _torch.accelerator.memory_reserved(_torch.device("neuron", _index(device)))


def max_memory_reserved(device: _DeviceLike = None) -> int:
    return _torch.accelerator.max_memory_reserved(_torch.device("neuron", _index(device)))


def reset_peak_memory_stats(device: _DeviceLike = None) -> None:
    _torch.accelerator.reset_peak_memory_stats(_torch.device("neuron", _index(device)))


def reset_accumulated_memory_stats(device: _DeviceLike = None) -> None:
    _torch.accelerator.reset_accumulated_memory_stats(_torch.device("neuron", _index(device)))


def empty_cache() -> None:
    """Returns to the host the memory of freed tensors that the caching allocator keeps for reuse
    (what `memory_reserved()` holds beyond `memory_allocated()`)."""
    _torch.accelerator.empty_cache()


def memory_summary(device: _DeviceLike = None, abbreviated: bool = False) -> str:
    index = _index(device)
    stats = memory_stats(index)
    free, total = _torch.accelerator.get_memory_info(_torch.device("neuron", index))
    rows = [
        ("allocated", stats.get("allocated_bytes.all.current", 0), stats.get("allocated_bytes.all.peak", 0)),
        ("reserved", stats.get("reserved_bytes.all.current", 0), stats.get("reserved_bytes.all.peak", 0)),
    ]
    lines = [f"neuron:{index} memory (reference device, capacity {total / 2**20:.1f} MiB, "
             f"free {free / 2**20:.1f} MiB)"]
    lines += [f"  {name:<10} current {current / 2**20:10.2f} MiB   peak {peak / 2**20:10.2f} MiB"
              for name, current, peak in rows]
    lines.append(f"  allocations: {stats.get('allocation.all.current', 0)} live, "
                 f"out-of-memory errors: {stats.get('num_ooms', 0)}")
    return "\n".join(lines)


# ---- torch.compile metrics ----

def get_dynamo_metrics() -> list[_Any]:
    """Per-graph metrics of TorchNeuron's compiler; the reference device's compile cache counts its own
    (`optimum_neuron_torch.compiler.cache_stats()`), so there are none here."""
    return []


def reset_dynamo_metrics() -> None:
    """Nothing is recorded (see `get_dynamo_metrics`)."""


def _sleep(cycles: int) -> None:
    """TorchNeuron's private test helper: nothing to wait for."""
