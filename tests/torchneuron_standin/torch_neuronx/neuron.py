"""`torch.neuron`: TorchNeuron's device module, with exactly its public functions.

Each function behaves as TorchNeuron's does (same arguments, same return conventions, same quirks:
`Stream(**kwargs)` takes keywords only, `set_device` does not take strings), delegating to the
top-level `torch_neuronx`. Everything imported for the implementation is private, so that
`dir(torch.neuron)` lists TorchNeuron's names only; looking up any other name from the library is
recorded (see `__getattr__`).
"""

import torch as _torch

import torch_neuronx as _tn
from torch_neuronx import (
    _runtime,
    memory,  # noqa: F401  (TorchNeuron exposes torch.neuron.memory)
)


def is_initialized() -> bool:
    """Whether the Neuron runtime started."""
    return _tn.is_neuron_runtime_initialized()


def current_device() -> int:
    """The current device index."""
    return _tn.current_device()


def set_device(device) -> None:
    """Makes a device (an index or a torch.device) current."""
    device_idx = getattr(device, "index", device)
    if device_idx is None:
        device_idx = current_device()
    _tn.set_device(device_idx)


def get_device_name(device=0) -> str:
    """`"neuron:<index>"`."""
    if isinstance(device, _torch.device):
        return str(device)
    if isinstance(device, int):
        return f"neuron:{device}"
    raise ValueError(
        f"Incorrect device argument found, expected torch.device or int type, found {type(device)}"
    )


def device_count() -> int:
    """NeuronCores this process sees; does not start the runtime."""
    return _tn.device_count()


def is_available() -> bool:
    """Whether this process sees any NeuronCore; does not start the runtime."""
    try:
        return _tn.device_count() > 0
    except Exception:  # noqa: BLE001  (as TorchNeuron: unavailable, whatever the reason)
        return False


def init() -> None:
    """Starts the Neuron runtime."""
    _tn._lazy_init()


def _lazy_init() -> None:
    _tn._lazy_init()


def get_amp_supported_dtype() -> list:
    """Dtypes `torch.autocast("neuron")` accepts."""
    return [_torch.float32, _torch.float16, _torch.bfloat16]


def _is_in_bad_fork() -> bool:
    return _tn._is_in_bad_fork


def _generator(index: int):
    return _tn._C.default_generator(index)


def manual_seed_all(seed: int) -> None:
    """Seeds every device's default generator."""
    seed = int(seed)
    for index in range(device_count()):
        _generator(index).manual_seed(seed)


def manual_seed(seed: int) -> None:
    """Seeds the current device's default generator."""
    _generator(current_device()).manual_seed(int(seed))


def seed() -> None:
    """Seeds the current device's generator with a random number."""
    _generator(current_device()).seed()


def seed_all() -> None:
    """Seeds every device with one random number."""
    random_seed = 0
    for index in range(device_count()):
        generator = _generator(index)
        if index == 0:
            generator.seed()
            random_seed = generator.initial_seed()
        else:
            generator.manual_seed(random_seed)


def initial_seed() -> int:
    """The current device's initial seed."""
    return _generator(current_device()).initial_seed()


def _index_of(device) -> int:
    if isinstance(device, str):
        device = _torch.device(device)
    elif isinstance(device, int):
        device = _torch.device("neuron", device)
    index = device.index if device is not None else None
    return current_device() if index is None else index


def get_rng_state(device=None):
    """The RNG state (a ByteTensor) of a device."""
    return _generator(_index_of(device)).get_state()


def set_rng_state(state, device=None) -> None:
    """Restores the RNG state of a device."""
    _generator(_index_of(device)).set_state(state)


def device(device_spec):
    """Context manager that makes a device current."""
    return _tn._Device(device_spec)


def Stream(**kwargs):
    """A neuron stream (keywords only, as in TorchNeuron)."""
    return _tn.Stream(**kwargs)


def stream(stream):
    """Context manager selecting a stream."""
    return _tn.stream(stream)


def current_stream(device=None):
    """The current stream of a device."""
    return _tn.current_stream(device)


def default_stream(device=None):
    """The default stream of a device."""
    return _tn.default_stream(device)


def set_stream(stream) -> None:
    """Makes a stream current."""
    _tn.set_stream(stream)


def synchronize(device=None) -> None:
    """Waits for the device's queued work (none: execution is synchronous)."""
    _tn.synchronize(device)


def wait_stream(stream) -> None:
    """Makes the current stream wait for another."""
    current_stream().wait_stream(stream)


def wait_event(event) -> None:
    """Makes the current stream wait for an event."""
    current_stream().wait_event(event)


def record_event(event=None):
    """Records an event on the current stream."""
    return current_stream().record_event(event)


def query() -> bool:
    """Whether the current stream's work is done."""
    return current_stream().query()


def Event(enable_timing=False, blocking=False):
    """A neuron event."""
    return _tn.Event(enable_timing=enable_timing, blocking=blocking)


def get_device_properties(device=None):
    """Name and total_memory of a device; starts the runtime."""
    return _tn.get_device_properties(str(device) if device is not None else current_device())


def reset_peak_memory_stats(device=None) -> None:
    """Restarts the peak statistics."""
    _tn.reset_peak_memory_stats(device)


def memory_stats(device=None) -> dict:
    """Allocator statistics in TorchNeuron's format."""
    return _tn.memory_stats(device)


def memory_allocated(device=None) -> int:
    """Bytes held by tensors."""
    return _tn.memory_allocated(device)


def max_memory_allocated(device=None) -> int:
    """Peak bytes held by tensors."""
    return _tn.max_memory_allocated(device)


def memory_reserved(device=None) -> int:
    """Bytes the allocator holds."""
    return _tn.memory_reserved(device)


def max_memory_reserved(device=None) -> int:
    """Peak bytes the allocator held."""
    return _tn.max_memory_reserved(device)


def reset_accumulated_memory_stats(device=None) -> None:
    """Resets the allocator's counters."""
    _tn.reset_accumulated_memory_stats(device)


def memory_summary(device=None, abbreviated=False) -> str:
    """A table of the allocator statistics."""
    return _tn.memory_summary(device, abbreviated)


def empty_cache() -> None:
    """Frees cached device memory (none is cached)."""
    _tn.empty_cache()


def _sleep(cycles: int) -> None:
    """TorchNeuron's private test helper: does nothing there either."""


def get_dynamo_metrics() -> list:
    """Per-graph metrics of the `neuron` torch.compile backend."""
    return _tn.get_dynamo_metrics()


def reset_dynamo_metrics() -> None:
    """Forgets the recorded torch.compile metrics."""
    _tn.reset_dynamo_metrics()


def is_bf16_supported() -> bool:
    """Trainium computes in bfloat16."""
    return True


def __getattr__(name: str):
    """Missing names: recorded when the library asks (see _runtime.report_miss), then AttributeError."""
    _runtime.report_miss(__name__, name, depth=3)  # (called by `StrictModule.__getattribute__`)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
