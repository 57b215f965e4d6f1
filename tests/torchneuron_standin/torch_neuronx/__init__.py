"""Test-only stand-in for TorchNeuron (`torch_neuronx` 2.13.3.0), the `neuron` PyTorch backend of Trainium.

optimum-neuron-torch's tests put this folder's parent on PYTHONPATH of subprocesses, so that the library
sees "TorchNeuron installed" on a machine without Trainium: torch autoloads it at `import torch` through
its `torch.backends` entry point, and it registers the `neuron` device and `torch.neuron` as TorchNeuron
does. Underneath, ops execute on the library's reference device extension (host memory, TorchNeuron's
support profile, silent CPU fallback). Its public names are exactly TorchNeuron's: a lookup of any other
name made from the library is recorded (TORCH_NEURONX_STANDIN_MISSES), so tests can prove that the library
stays within TorchNeuron's surface. See ../README.md for what is and is not simulated.
"""

__version__ = "2.13.3.0"

# TorchNeuron's top-level names (its submodules `distributed, neuron, profiling, python_ops, kernels,
# metrics` are attributes too, as are `memory` and `neuron_dynamo_backend`, which it imports).
__all__ = [
    "Event", "NeuronProfiler", "Stream", "clear_op_tracking", "current_device", "current_stream",
    "default_stream", "device_count", "distributed", "empty_cache", "get_device_properties",
    "get_dynamo_metrics", "get_executed_ops", "get_fallback_ops", "is_neuron_runtime_initialized",
    "kernels", "max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved",
    "memory_stats", "memory_summary", "metrics", "neuron", "nki_op", "profiling", "python_ops",
    "reset_accumulated_memory_stats", "reset_dynamo_metrics", "reset_peak_memory_stats", "set_device",
    "set_stream", "stream", "synchronize", "wrap_nki",
]

import os as _os
import threading as _threading
import time as _time

# TorchNeuron's defaults, set at import as a release build sets them (users may override them).
_os.environ.setdefault("NEURON_LAUNCH_BLOCKING", "1")
_os.environ.setdefault("TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS", "0")
_os.environ.setdefault("TORCH_NEURONX_MLIR_ATEN_OPS", "1")
_os.environ.setdefault("TORCH_NEURONX_RETAIN_DEVICE_MODE", "0")
_os.environ.setdefault("NEURON_RT_ALLOW_LEGACY_NEFF", "1")
_os.environ.setdefault("NEURON_RT_DBG_ZEROCOPY", "1")
_os.environ.setdefault("TORCH_NEURONX_ENABLE_ASYNC_NRT", "1")
_os.environ.setdefault("TORCH_NEURONX_ENABLE_STACK_TRACE", "0")

import torch as _torch

from . import _runtime

_config = _runtime.read_config()
_machine_cores = _runtime.machine_cores()
_C = _runtime.load_extension(_config["extension"])  # the reference device, as TorchNeuron's `_C`


# Set by the process group's setup, as TorchNeuron's `_set_local_world_size` and `_set_local_device_start_index`
# (csrc/core/NeuronDevice.cpp): PyTorch's device index is then the local rank, and `device_count()` the
# local world size, while the process drives one core (its VNC 0).
_local_world_size = -1
_local_device_start_index = -1


def _vnc_count() -> int:
    """The cores (VNCs) this process drives: the visible cores that exist (NeuronDevice.cpp `vnc_count`)."""
    return _runtime.device_count(_machine_cores)


def _addressable_devices() -> int:
    """`device_count()`: the local world size once the process group set it up, else the VNCs (NeuronDevice.cpp)."""
    return _local_world_size if _local_world_size != -1 else _vnc_count()


def _refresh_device_count() -> None:
    """Tells the extension how many devices this process addresses (at least 1: it cannot have none)."""
    _C.set_device_count(max(1, _addressable_devices()))


def _set_local_devices(local_world_size: int, start_index: int) -> None:
    """What TorchNeuron's distributed setup does: device indices from `start_index` (the local rank),
    `device_count()` the local world size, the current device the local rank."""
    global _local_world_size, _local_device_start_index
    _local_world_size, _local_device_start_index = local_world_size, start_index
    _refresh_device_count()
    _C.set_current_device(start_index)


_refresh_device_count()
# Without NeuronCores the device still exists, but nothing fits in it.
_C.set_capacity(_runtime.core_memory() if _machine_cores else 0)

# Runtime state. TorchNeuron starts its runtime lazily: `_lazy_init` (device properties, `init()`), or
# the first device allocation. A process forked after that cannot use the device.
_initialized = False
_original_pid = 0
_initialization_lock = _threading.RLock()
_is_in_bad_fork = False
_started_before_fork = False


def _device_used() -> bool:
    """Whether any device memory was ever allocated: in TorchNeuron that starts the runtime."""
    for index in range(_C.device_count()):
        stats = _torch.accelerator.memory_stats(_torch.device("neuron", index))
        if stats.get("num_device_alloc", 0) > 0 or stats.get("allocation.all.current", 0) > 0:
            return True
    return False


def _runtime_started() -> bool:
    global _initialized, _original_pid
    if not _initialized and not _is_in_bad_fork and _device_used():
        _initialized, _original_pid = True, _os.getpid()
    return _initialized


def _lazy_init() -> None:
    """Starts the (simulated) Neuron runtime once; refuses in a child forked after it started."""
    global _initialized, _original_pid
    if _initialized:
        return
    with _initialization_lock:
        if _initialized:
            return
        if _is_in_bad_fork:
            raise RuntimeError(
                "Cannot re-initialize Neuron runtime in forked subprocess. "
                "To use Neuron with multiprocessing, use the 'spawn' start method"
            )
        _runtime.check_visible(_machine_cores)
        _original_pid = _os.getpid()
        _initialized = True


def _before_fork() -> None:
    global _started_before_fork
    _started_before_fork = _runtime_started()


def _after_fork_in_child() -> None:
    """A child of a process whose runtime started cannot use the device: allocations fail."""
    global _initialized, _is_in_bad_fork
    if _started_before_fork:
        _initialized = False
        _is_in_bad_fork = True
        _C.set_capacity(0)


_os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)

# Imported here on purpose: the submodules use the runtime state and functions defined above
# (`neuron` imports names from this partly initialized package).
from . import kernels, metrics, neuron, profiling, python_ops  # noqa: E402
from .memory import (  # noqa: E402
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
)
from .neuron_dynamo_backend.metrics import get_dynamo_metrics, reset_dynamo_metrics  # noqa: E402
from .profiling import NeuronProfiler  # noqa: E402

_torch.utils.rename_privateuse1_backend("neuron")
_C.register_hooks()
_torch._register_device_module("neuron", neuron)
_torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
_C.set_profile(False, list(_config["native_ops"]))
_C.route_through_device(list(_config["route_ops"]))
_C.set_fallback_mode(_C.FallbackMode.silent)  # silent: TorchNeuron's CPU fallback prints nothing
_C.set_fallback_copies(True)  # and copies inputs to the CPU and results back


def _autoload() -> None:
    """Entry point of torch's device-backend autoload: importing this package did everything."""


def is_neuron_runtime_initialized() -> bool:
    """Whether the runtime started (by `_lazy_init` or a first allocation). Does not start it."""
    return _runtime_started()


def device_count() -> int:
    """NeuronCores this process sees (TORCH_NEURONX_STANDIN_CORES, NEURON_RT_VISIBLE_CORES), or, once the
    process group set it up, the local world size (NeuronDevice.cpp `device_count`). Starts nothing."""
    return _addressable_devices()


def current_device() -> int:
    """The current device index."""
    return _C.current_device()


def set_device(device: int) -> None:
    """Makes `device` (an index) the current device: an index of this process's own cores only, from the
    local rank on once the process group set it up (NeuronDevice.cpp `set_device`)."""
    if device < 0 or device >= device_count():
        raise ValueError(f"Invalid device id: {device}. Valid range is 0 to {device_count() - 1}")
    start = max(_local_device_start_index, 0)
    if device < start or device >= start + _vnc_count():
        raise ValueError(f"Device index {device} is out of range. Valid range is {start} to "
                         f"{start + _vnc_count() - 1} for this process")
    _C.set_current_device(device)


class _DeviceProperties:
    """What `get_device_properties` returns: TorchNeuron's NeuronDeviceProperties."""

    __slots__ = ("name", "total_memory")

    def __init__(self, name: str, total_memory: int):
        self.name = name
        self.total_memory = total_memory

    def __repr__(self) -> str:
        return f"<NeuronDeviceProperties(name='{self.name}', total_memory={self.total_memory})>"


def get_device_properties(device) -> _DeviceProperties:
    """Name (the instance type) and memory of a device, given as an index or "neuron:i". Starts the runtime."""
    if isinstance(device, str) and "neuron" in device:
        parsed = _torch.device(device)
        if parsed.type != "neuron":
            raise ValueError(f"Expected neuron device, got {parsed.type}")
        index = parsed.index if parsed.index is not None else 0
    else:
        index = int(device)
    if index < 0 or index >= device_count():
        raise ValueError(f"Invalid device id: {index}")
    _lazy_init()
    # TorchNeuron asks the runtime for the memory of VNC `index` (the PyTorch index, NeuronBindings.cpp
    # `neuron_getDeviceProperties`): a process drives VNCs 0..vnc_count-1, so from the local rank 1 of a
    # job on, the query fails and total_memory is 0 ("Falling back to total_memory=0").
    return _DeviceProperties(_runtime.INSTANCE_TYPE, _C.capacity() if index < _vnc_count() else 0)


def empty_cache() -> None:
    """Frees cached blocks: the reference allocator caches nothing."""


# Asynchronous mode (NEURON_LAUNCH_BLOCKING=0): ops are recorded when queued work runs, which the stand-in
# models as "when synchronize() is called": the lists show what was recorded up to the last synchronize().
_synchronized_ops: tuple[frozenset, frozenset] = (frozenset(), frozenset())


def _asynchronous() -> bool:
    return _os.environ.get("NEURON_LAUNCH_BLOCKING", "1") == "0"


def _recorded_ops() -> tuple[frozenset, frozenset]:
    return frozenset(op for op, _, _ in _C.fallback_counts()), frozenset(_C.executed_ops())


def get_fallback_ops() -> list:
    """Ops that ran on the CPU since the last clear: each name once, in no particular order."""
    return list((_synchronized_ops if _asynchronous() else _recorded_ops())[0])


def get_executed_ops() -> list:
    """Ops that ran natively on the device since the last clear: each name once, in no particular order."""
    return list((_synchronized_ops if _asynchronous() else _recorded_ops())[1])


def clear_op_tracking() -> None:
    """Forgets both lists of ops."""
    global _synchronized_ops
    _C.clear_op_tracking()
    _synchronized_ops = (frozenset(), frozenset())


def _get_device_index(device, optional: bool = False) -> int | None:
    if device is None:
        return None if optional else current_device()
    if isinstance(device, str):
        device = _torch.device(device)
    if isinstance(device, _torch.device):
        if device.type != "neuron":
            raise ValueError(f"Expected neuron device, got {device.type}")
        return device.index if device.index is not None else current_device()
    if isinstance(device, int):
        return device
    raise ValueError(f"Invalid device specification: {device}")


def synchronize(device=None) -> None:
    """Waits for queued work: execution is synchronous here, so only the device is checked."""
    global _synchronized_ops
    index = _get_device_index(device, optional=True)
    if index is not None and not 0 <= index < max(1, device_count()):
        raise ValueError(f"Invalid device id: {index}")
    _synchronized_ops = _recorded_ops()


_PRIVATEUSE1_TYPE = 20  # c10::DeviceType::PrivateUse1, as torch.Stream wants it


class Stream(_torch.Stream):
    """A neuron stream (work is synchronous: it is always complete)."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        if "stream_id" in kwargs and "device_index" in kwargs and "device_type" in kwargs:
            return super().__new__(
                cls, stream_id=kwargs["stream_id"], device_index=kwargs["device_index"],
                device_type=kwargs["device_type"],
            )
        index = _get_device_index(device)
        return super().__new__(cls, device=_torch.device("neuron", index), priority=priority)

    def record_event(self, event: "Event | None" = None) -> "Event":
        """Records `event` (a new one when None) on this stream, as TorchNeuron's Stream does."""
        if event is None:
            event = Event()
        event.record(self)
        return event


class Event(_torch.Event):
    """A neuron event. torch.Event's C++ methods refuse subclasses as arguments, so timing is kept here:
    `elapsed_time` measures host time between two records (execution is synchronous)."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False):
        event = super().__new__(cls, device="neuron", enable_timing=enable_timing, blocking=blocking)
        event._timing = enable_timing
        event._recorded_at = None
        return event

    def record(self, stream=None) -> None:
        super().record(stream)
        self._recorded_at = _time.perf_counter()

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds between this event's record and `end_event`'s."""
        if not (self._timing and getattr(end_event, "_timing", False)):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


def _as_stream(stream: _torch.Stream) -> Stream:
    return Stream(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type)


def current_stream(device=None) -> Stream:
    """The current stream of a device."""
    index = _get_device_index(device)
    return _as_stream(_torch.accelerator.current_stream(_torch.device("neuron", index)))


def default_stream(device=None) -> Stream:
    """The default stream (id 0) of a device."""
    index = _get_device_index(device)
    return Stream(stream_id=0, device_index=index, device_type=_PRIVATEUSE1_TYPE)


def set_stream(stream: Stream) -> None:
    """Makes `stream` current on its device."""
    if stream is None:
        return
    _torch.accelerator.set_stream(stream)


class _Device:
    """Context manager that makes a device current (TorchNeuron's `torch_neuronx.device`)."""

    def __init__(self, device):
        self.idx = _get_device_index(device)
        self.prev_idx = -1

    def __enter__(self) -> None:
        if self.idx == -1:
            return
        self.prev_idx = current_device()
        if self.prev_idx != self.idx:
            set_device(self.idx)

    def __exit__(self, *exc) -> None:
        if self.prev_idx not in (self.idx, -1):
            set_device(self.prev_idx)


class _StreamContext:
    """Context manager that makes a stream current for a block."""

    def __init__(self, stream):
        self.stream = stream
        self.previous = None

    def __enter__(self) -> None:
        if self.stream is None:
            return
        self.previous = current_stream(self.stream.device_index)
        set_stream(self.stream)

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            set_stream(self.previous)


def stream(stream) -> _StreamContext:
    """Context manager selecting `stream`."""
    return _StreamContext(stream)


def nki_op(*args, **kwargs):
    """NKI kernels need Trainium: not simulated."""
    raise NotImplementedError("the TorchNeuron stand-in does not run NKI kernels (nki_op)")


def wrap_nki(*args, **kwargs):
    """NKI kernels need Trainium: not simulated."""
    raise NotImplementedError("the TorchNeuron stand-in does not run NKI kernels (wrap_nki)")


def __getattr__(name: str):
    """Missing names: recorded when the library asks (see _runtime.report_miss), then AttributeError."""
    _runtime.report_miss(__name__, name, depth=3)  # (called by `StrictModule.__getattribute__`)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


from . import distributed  # noqa: E402  (last on purpose: registers the c10d backend "neuron" once all is defined)

_runtime.make_strict(__name__)
_runtime.make_strict(neuron.__name__)
