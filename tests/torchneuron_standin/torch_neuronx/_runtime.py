"""What the stand-in runs on: its config, the reference device's extension, and the simulated machine.

Nothing here imports `optimum_neuron_torch`: torch autoloads this package during `import torch`,
before the library exists in the process. The library's test harness writes the config instead
(`tests/torchneuron_standin/make_config.py`).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import PurePath
from types import ModuleType

CONFIG_ENV = "TORCH_NEURONX_STANDIN_CONFIG"
CORES_ENV = "TORCH_NEURONX_STANDIN_CORES"
MISSES_ENV = "TORCH_NEURONX_STANDIN_MISSES"
VISIBLE_CORES_ENV = "NEURON_RT_VISIBLE_CORES"

# One Trn2 logical NeuronCore (LNC=2) has 24 GiB of HBM; here it is host memory, so capped by it.
CORE_MEMORY = 24 * 1024**3
# What `get_device_properties().name` says: TorchNeuron reports the instance type.
INSTANCE_TYPE = "trn2.48xlarge"
# The extension's device count must be at least 1, so "no NeuronCores" gets one device of no memory.
_MAX_CORES = 64


def read_config() -> dict:
    """The JSON file named by TORCH_NEURONX_STANDIN_CONFIG: {extension, native_ops, route_ops}."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        raise ImportError(
            f"torch_neuronx here is the test-only TorchNeuron stand-in of optimum-neuron-torch; it needs "
            f"{CONFIG_ENV} (a JSON file written by tests/torchneuron_standin/make_config.py) to find the "
            "reference device's compiled extension. Remove tests/torchneuron_standin from PYTHONPATH, or set it."
        )
    try:
        with open(path) as file:
            config = json.load(file)
    except (OSError, ValueError) as error:
        raise ImportError(f"{CONFIG_ENV}={path!r} cannot be read as the stand-in's config: {error}") from error
    missing = {"extension", "native_ops", "route_ops"} - set(config)
    if missing:
        raise ImportError(f"{CONFIG_ENV}={path!r} lacks {', '.join(sorted(missing))}: rewrite it with make_config.py")
    return config


def load_extension(path: str) -> ModuleType:
    """Imports the compiled reference-device extension (a pybind11 module named after its file stem)."""
    name = PurePath(path).name.split(".")[0]
    if name in sys.modules:
        return sys.modules[name]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None or not os.path.exists(path):
        raise ImportError(f"the reference device extension {path!r} (from {CONFIG_ENV}) does not exist: "
                          "rebuild the config")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def machine_cores() -> int:
    """NeuronCores the simulated machine has (TORCH_NEURONX_STANDIN_CORES, default 1; 0 = none)."""
    text = os.environ.get(CORES_ENV, "1").strip() or "1"
    if not text.isdigit() or int(text) > _MAX_CORES:
        raise ImportError(f"{CORES_ENV}={text!r} must be a whole number from 0 to {_MAX_CORES}")
    return int(text)


def visible_cores(machine: int) -> list[int]:
    """The cores this process may use: NEURON_RT_VISIBLE_CORES ("0", "0,2", "0-3") or all of them.

    Listed cores the machine lacks are kept, so that `check_visible` can refuse them as the runtime does.
    """
    text = os.environ.get(VISIBLE_CORES_ENV, "").strip()
    if not text:
        return list(range(machine))
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            cores.extend(range(int(first), int(last or first) + 1))
        except ValueError:
            raise RuntimeError(f"{VISIBLE_CORES_ENV}={text!r} is not a list of NeuronCore indices") from None
    return sorted(set(cores))


def device_count(machine: int) -> int:
    """Devices this process sees: the visible cores that exist on the machine."""
    return len([core for core in visible_cores(machine) if core < machine])


def check_visible(machine: int) -> None:
    """Raises as the Neuron runtime does when it starts without usable cores."""
    if machine == 0:
        raise RuntimeError(
            f"Neuron runtime initialization failed: no NeuronCores on this machine (stand-in: {CORES_ENV}=0)"
        )
    absent = [core for core in visible_cores(machine) if core >= machine]
    if absent:
        raise RuntimeError(
            f"Neuron runtime initialization failed: {VISIBLE_CORES_ENV}={os.environ[VISIBLE_CORES_ENV]!r} names "
            f"NeuronCore(s) {absent}, but the machine has {machine} (stand-in: {CORES_ENV})"
        )


def core_memory() -> int:
    """One core's memory in bytes: 24 GiB, capped by the host's available memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return min(CORE_MEMORY, int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    return 4 * 1024**3


# The names TorchNeuron's modules define (top-level functions, classes, assignments and imports of
# `torch_neuronx/__init__.py` and `torch_neuronx/neuron.py`, its `torch.neuron`), private ones included.
# The stand-in has helpers of its own besides; a library lookup of one of those is a miss too.
SURFACES = {
    "torch_neuronx": frozenset({
        "DEFAULT_FALLBACK_ONLY_FOR_UNIMPLEMENTED", "DEFAULT_MLIR_ATEN_OPS", "DEFAULT_RETAIN_DEVICE_MODE",
        "DEFAULT_SYNC_MODE", "Event", "NeuronProfiler", "Stream", "StreamContext", "_C", "_after_fork", "_autoload",
        "_get_device_index", "_initialization_lock", "_initialized", "_is_in_bad_fork", "_is_loaded", "_lazy_init",
        "_original_pid", "_real_torch_device", "clear_op_tracking", "current_device", "current_stream",
        "default_stream", "device", "device_count", "distributed", "empty_cache", "get_device_properties",
        "get_dynamo_metrics", "get_executed_ops", "get_fallback_ops", "is_neuron_runtime_initialized", "kernels",
        "max_memory_allocated", "max_memory_reserved", "memory", "memory_allocated", "memory_reserved",
        "memory_stats", "memory_summary", "metrics", "neuron", "neuron_dynamo_backend", "nki_hop", "nki_op", "os",
        "profiling", "python_ops", "reset_accumulated_memory_stats", "reset_dynamo_metrics",
        "reset_peak_memory_stats", "set_device", "set_stream", "stream", "streams", "synchronize", "threading",
        "torch", "wrap_nki",
    }),
    "torch_neuronx.neuron": frozenset({
        "Event", "Stream", "_is_in_bad_fork", "_sleep", "current_device", "current_stream", "default_stream",
        "device", "device_count", "empty_cache", "get_amp_supported_dtype", "get_device_name",
        "get_device_properties", "get_dynamo_metrics", "get_rng_state", "init", "initial_seed", "is_available",
        "is_bf16_supported", "is_initialized", "manual_seed", "manual_seed_all", "max_memory_allocated",
        "max_memory_reserved", "memory", "memory_allocated", "memory_reserved", "memory_stats", "memory_summary",
        "query", "record_event", "reset_accumulated_memory_stats", "reset_dynamo_metrics", "reset_peak_memory_stats",
        "seed", "seed_all", "set_device", "set_rng_state", "set_stream", "stream", "synchronize", "wait_event",
        "wait_stream",
        # Not TorchNeuron's: the stand-in's hook to start its runtime at the first allocation (TorchNeuron's
        # allocator starts it). PyTorch's C++ looks it up at every device tensor creation, from whatever Python
        # frame is running, so it cannot tell the library's lookups from PyTorch's.
        "_lazy_init",
    }),
}


class StrictModule(ModuleType):
    """A module of the stand-in whose names beyond TorchNeuron's (`SURFACES`) count as misses when the
    library looks them up: they exist here, not on Trn."""

    def __getattribute__(self, name: str):
        value = super().__getattribute__(name)  # (a missing name: the module's `__getattr__` reports it)
        surface = SURFACES[ModuleType.__getattribute__(self, "__name__")]
        if name not in surface:
            report_miss(ModuleType.__getattribute__(self, "__name__"), name)
        return value


def make_strict(module_name: str) -> None:
    """Makes `module_name` (an entry of `SURFACES`) a `StrictModule`."""
    sys.modules[module_name].__class__ = StrictModule


def report_miss(module: str, name: str, depth: int = 2) -> None:
    """Records a name the library looked up on TorchNeuron's modules that they do not have (missing
    here too, or a helper of the stand-in's own: see `StrictModule`).

    Only lookups made from a file inside a directory named `optimum_neuron_torch` count (torch's own
    probing, e.g. `hasattr(torch.neuron, ...)`, does not), written as a line `module.name` to the file
    named by TORCH_NEURONX_STANDIN_MISSES, when set. `depth` is how many frames out the lookup's caller
    is (2 from `StrictModule.__getattribute__`, 3 from a module `__getattr__` it calls). Import
    machinery probing for a submodule (`from torch_neuronx import neuron_dynamo_backend`) runs in
    importlib's frames, so it does not count; a missing name imported that way still does.
    """
    path = os.environ.get(MISSES_ENV)
    if not path or (name.startswith("__") and name.endswith("__")):
        return  # dunders (`__path__`, `__wrapped__`...) are Python's protocol, not TorchNeuron's surface
    frame = sys._getframe(depth)
    if "optimum_neuron_torch" not in PurePath(frame.f_code.co_filename).parts[:-1]:
        return
    with open(path, "a") as misses:
        misses.write(f"{module}.{name}\n")
