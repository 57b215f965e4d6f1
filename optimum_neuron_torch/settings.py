"""Every setting of optimum-neuron-torch in one place: the environment variables it reads, their
defaults and parsers, and where it keeps its caches.

| variable | default | meaning |
| --- | --- | --- |
| `OPTIMUM_NEURON_TORCH_BACKEND` | `auto` | `auto`, `torchneuron` or `reference`: which backend provides `neuron` |
| `OPTIMUM_NEURON_TORCH_FALLBACK` | `warn` | `warn`, `error` or `silent`: what an op without a native kernel does |
| `OPTIMUM_NEURON_TORCH_CACHE` | `$XDG_CACHE_HOME/optimum-neuron-torch` | root of the library's caches |
| `OPTIMUM_NEURON_TORCH_COMPILE_CACHE` | `<cache root>/compiled` | the compile cache |
| `OPTIMUM_NEURON_TORCH_DISTRIBUTED_TIMEOUT` | `1800` | seconds a rank waits for the others in a process group the library starts |
| `OPTIMUM_NEURON_TORCH_DISABLE_GRAPH_SPLIT` | `0` | the library's compiled paths refuse graphs TorchNeuron cannot take instead of splitting them |
| `OPTIMUM_NEURON_TORCH_DISABLE_LAYER_REUSE` | `0` | compile generation graphs whole instead of a program per distinct layer |
| `OPTIMUM_NEURON_TORCH_PROFILE` | `torchneuron` | reference device: its support profile (`torchneuron`, `full` or an op list) |
| `OPTIMUM_NEURON_TORCH_DEVICE_MEMORY` | 24 GiB, capped by the host | reference device: memory per device |
| `OPTIMUM_NEURON_TORCH_DEVICE_COUNT` | `1`, or `LOCAL_WORLD_SIZE` under a launcher | reference device: number of devices |
| `OPTIMUM_NEURON_TORCH_FALLBACK_COPY` | `0` | reference device: copy fallback inputs and results as TorchNeuron does |
| `OPTIMUM_NEURON_TORCH_API_KEY` | unset | `serve`: the key clients must send (`--api-key` overrides it) |

Each setting is read when it is used (the backend and the reference device's settings once, when
the device is activated), so tests and users may set the variables after import.
"""  # noqa: E501 (a Markdown table row above cannot be wrapped)

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigurationError
from .host import available_memory

BACKEND_ENV = "OPTIMUM_NEURON_TORCH_BACKEND"
FALLBACK_ENV = "OPTIMUM_NEURON_TORCH_FALLBACK"
CACHE_ENV = "OPTIMUM_NEURON_TORCH_CACHE"
COMPILE_CACHE_ENV = "OPTIMUM_NEURON_TORCH_COMPILE_CACHE"
DISABLE_GRAPH_SPLIT_ENV = "OPTIMUM_NEURON_TORCH_DISABLE_GRAPH_SPLIT"
DISABLE_LAYER_REUSE_ENV = "OPTIMUM_NEURON_TORCH_DISABLE_LAYER_REUSE"
PROFILE_ENV = "OPTIMUM_NEURON_TORCH_PROFILE"
DEVICE_MEMORY_ENV = "OPTIMUM_NEURON_TORCH_DEVICE_MEMORY"
DEVICE_COUNT_ENV = "OPTIMUM_NEURON_TORCH_DEVICE_COUNT"
FALLBACK_COPY_ENV = "OPTIMUM_NEURON_TORCH_FALLBACK_COPY"
API_KEY_ENV = "OPTIMUM_NEURON_TORCH_API_KEY"

# Variables of PyTorch and TorchNeuron the library reads (never sets, but for the one below).
AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"
NEFF_CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
NEFF_CACHE_DEFAULT = "/tmp/neff_cache"  # TorchNeuron's default
CXX_ENV = "CXX"  # the C++ compiler (as for PyTorch's extension builder)
VISIBLE_CORES_ENV = "NEURON_RT_VISIBLE_CORES"  # the NeuronCores a process of TorchNeuron's runtime sees
# TorchNeuron's variable the library sets, under the `error` fallback policy only (the user's value
# comes back when the policy changes): a graph that fails on the device raises instead of re-running eagerly.
DISABLE_FALLBACK_EXECUTION_ENV = "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"
# Set by torchrun (and other launchers) in each process: one neuron device per local rank.
DISTRIBUTED_TIMEOUT_ENV = "OPTIMUM_NEURON_TORCH_DISTRIBUTED_TIMEOUT"
# The launcher's (torchrun sets them for each rank)
RANK_ENV = "RANK"
WORLD_SIZE_ENV = "WORLD_SIZE"
LOCAL_RANK_ENV = "LOCAL_RANK"
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"
# torch's launcher: how long it waits for the ranks to exit after passing them a signal (default 30 s;
# `commands.launch` sets it for a server's drain, when the user has not)
ELASTIC_SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
# What `optimum-cli neuron-torch env` reports: the library's, TorchNeuron's and the Neuron runtime's
# variables (by prefix), and those of PyTorch, the Hub and the host that change what the library does.
ENV_PREFIX = "OPTIMUM_NEURON_TORCH_"
REPORTED_PREFIXES = (ENV_PREFIX, "TORCH_NEURONX_", "NEURON_")
REPORTED_VARIABLES = (AUTOLOAD_ENV, "HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_DISABLE_PROGRESS_BARS",
                      "TRANSFORMERS_OFFLINE", "XDG_CACHE_HOME", CXX_ENV, "OMP_NUM_THREADS")
# TorchNeuron's compiled-graph cache: its variables, and what applies when one is not set.
NEFF_CACHE_VARIABLES = {
    NEFF_CACHE_ENV: NEFF_CACHE_DEFAULT,
    "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": "/tmp/local_cache",
    "TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT": "1200",
    "TORCH_NEURONX_DISABLE_NEFF_CACHE": "unset (cache on)",
    "TORCH_NEURONX_NEFF_DISABLE_CACHE": "unset (cache on)",
}

BACKENDS = ("auto", "torchneuron", "reference")
FALLBACK_MODES = ("warn", "error", "silent")
PROFILES = ("torchneuron", "full")  # or the path of an op list
DEFAULT_DISTRIBUTED_TIMEOUT = 1800.0
MAX_DEVICE_COUNT = 64  # a trn2.48xlarge: 16 chips of 4 logical NeuronCores
# One Trn2 logical NeuronCore (LNC=2) has 24 GiB of HBM.
TRN2_LOGICAL_CORE_MEMORY = 24 * 1024**3

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


# Parsers -----------------------------------------------------------------------------------------
def parse_flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable `name`: `1/true/yes/on` or `0/false/no/off` (any case).

    Raises:
        ConfigurationError: any other value.
    """
    text = os.environ.get(name)
    if text is None:
        return default
    text = text.strip().lower()
    if text not in _TRUE + _FALSE:
        raise ConfigurationError(f"{name}={text!r} must be 0 or 1 (or true/false, yes/no, on/off).")
    return text in _TRUE


def parse_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The environment variable `name`, lower-cased, one of `choices` (`default` when unset or empty).

    Raises:
        ConfigurationError: any other value.
    """
    text = os.environ.get(name, "").strip().lower() or default
    if text not in choices:
        raise ConfigurationError(f"{name}={text!r} must be one of {', '.join(choices)}.")
    return text


def parse_bytes(text: str, name: str = DEVICE_MEMORY_ENV) -> int:
    """Parses `1073741824`, `24GiB`, `512 MB` and the like into a positive number of bytes.

    Raises:
        ConfigurationError: not a size, or not positive (the message names `name`).
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigurationError(f"{name}={text!r} is not a size: write bytes, "
                                 "or a number with a unit such as 24GiB or 512MB.")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ConfigurationError(f"{name}={text!r} must be a positive size.")
    return size


# Settings of the whole library -------------------------------------------------------------------
def requested_backend() -> str:
    """`OPTIMUM_NEURON_TORCH_BACKEND`: `auto` (default), `torchneuron` or `reference`."""
    return parse_choice(BACKEND_ENV, BACKENDS, "auto")


def requested_fallback_mode() -> str:
    """`OPTIMUM_NEURON_TORCH_FALLBACK`: the fallback policy at start, `warn` (default), `error` or `silent`."""
    return parse_choice(FALLBACK_ENV, FALLBACK_MODES, "warn")


def fallback_mode_is_set() -> bool:
    """Whether `OPTIMUM_NEURON_TORCH_FALLBACK` is set: the user chose the policy (not the default)."""
    return FALLBACK_ENV in os.environ


def replace_disable_fallback_execution(value: str | None) -> str | None:
    """Sets TorchNeuron's `TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION` to `value` (None: unset), which
    TorchNeuron reads at each failed execution of a compiled graph; returns the value it had."""
    previous = os.environ.get(DISABLE_FALLBACK_EXECUTION_ENV)
    if value is None:
        os.environ.pop(DISABLE_FALLBACK_EXECUTION_ENV, None)
    else:
        os.environ[DISABLE_FALLBACK_EXECUTION_ENV] = value
    return previous


def serving_api_key() -> str | None:
    """`OPTIMUM_NEURON_TORCH_API_KEY`: the key clients of `optimum-cli neuron-torch serve` must send
    (None when unset or empty: no key). An environment variable keeps it out of the process list."""
    return os.environ.get(API_KEY_ENV) or None


def cache_dir() -> Path:
    """Root of the library's on-disk caches (the reference device's builds, compiled graphs, the
    converted default model): `$OPTIMUM_NEURON_TORCH_CACHE`, else `optimum-neuron-torch` in
    `$XDG_CACHE_HOME` (`~/.cache`)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "optimum-neuron-torch"


def compile_cache_dir() -> Path:
    """The compile cache: `$OPTIMUM_NEURON_TORCH_COMPILE_CACHE`, else `compiled/` in `cache_dir()`."""
    if os.environ.get(COMPILE_CACHE_ENV):
        return Path(os.environ[COMPILE_CACHE_ENV]).expanduser()
    return cache_dir() / "compiled"


def neff_cache_dir() -> Path:
    """Where TorchNeuron keeps its compiled NEFFs (`TORCH_NEURONX_NEFF_CACHE_DIR`); on TorchNeuron,
    that cache is in charge."""
    return Path(os.environ.get(NEFF_CACHE_ENV) or NEFF_CACHE_DEFAULT)


def cxx_compiler() -> str:
    """The C++ compiler that builds the reference device: `$CXX`, else `c++`."""
    return os.environ.get(CXX_ENV) or "c++"


def launched() -> bool:
    """Whether this process is one rank of a job that a launcher (`torchrun`) started."""
    return WORLD_SIZE_ENV in os.environ


def launcher_rank() -> int:
    """This process's rank in the job (`RANK`; 0 without a launcher)."""
    return int(os.environ.get(RANK_ENV, "0"))


def launcher_local_rank() -> int:
    """This process's rank on its host (`LOCAL_RANK`; 0 without a launcher)."""
    return int(os.environ.get(LOCAL_RANK_ENV, "0"))


def visible_cores() -> str | None:
    """The NeuronCores this process may use (`NEURON_RT_VISIBLE_CORES`, e.g. "0" or "0-3"), None when
    not set (TorchNeuron's process group then gives each rank the core of its local rank)."""
    return os.environ.get(VISIBLE_CORES_ENV)


def launcher_world_size() -> int:
    """The number of processes of the job (`WORLD_SIZE`; 1 without a launcher)."""
    return int(os.environ.get(WORLD_SIZE_ENV, "1"))


def launched_locally() -> bool:
    """Whether a launcher gave this process a rank on its host (`LOCAL_RANK` is set)."""
    return LOCAL_RANK_ENV in os.environ


def launcher_local_world_size() -> int:
    """The number of processes of the job on this host (`LOCAL_WORLD_SIZE`; 1 without a launcher)."""
    return int(os.environ.get(LOCAL_WORLD_SIZE_ENV, "1"))


def reported_variables() -> dict[str, str]:
    """The variables `optimum-cli neuron-torch env` reports that are set (`REPORTED_PREFIXES`,
    `REPORTED_VARIABLES`), by name."""
    return {name: value for name, value in sorted(os.environ.items())
            if name.startswith(REPORTED_PREFIXES) or name in REPORTED_VARIABLES}


def neff_cache_variables() -> dict[str, str]:
    """TorchNeuron's compiled-graph cache variables (`NEFF_CACHE_VARIABLES`): each one's value, or
    what applies when it is not set, marked `(default)`."""
    return {name: os.environ.get(name, f"{default} (default)") for name, default in NEFF_CACHE_VARIABLES.items()}


def distributed_timeout() -> float:
    """Seconds a collective of a process group the library starts waits for the other ranks before
    it fails (`OPTIMUM_NEURON_TORCH_DISTRIBUTED_TIMEOUT`, default 30 minutes: ranks of a large model
    finish loading minutes apart)."""
    text = os.environ.get(DISTRIBUTED_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_DISTRIBUTED_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigurationError(f"{DISTRIBUTED_TIMEOUT_ENV}={text!r} must be a positive number of seconds.")
    return seconds


def graph_split_disabled() -> bool:
    """`OPTIMUM_NEURON_TORCH_DISABLE_GRAPH_SPLIT`: refuse a graph with ops TorchNeuron's compiler
    cannot take instead of splitting it (default: split)."""
    return parse_flag(DISABLE_GRAPH_SPLIT_ENV)


def layer_reuse_disabled() -> bool:
    """`OPTIMUM_NEURON_TORCH_DISABLE_LAYER_REUSE`: compile generation's graphs whole, each holding
    every decoder layer, instead of one program per distinct layer called once per layer (see
    `compiler/regions.py`): fewer program launches per step, a compile time that grows with the
    number of layers."""
    return parse_flag(DISABLE_LAYER_REUSE_ENV)


# Settings of the reference device ----------------------------------------------------------------
@dataclass(frozen=True)
class ReferenceDeviceSettings:
    """What the environment asks of the reference device, read once when it is activated."""

    device_memory: int
    device_count: int
    profile: str
    fallback_copies: bool
    default_device: int = 0  # the device threads start on: the local rank under a launcher


def default_device_memory() -> int:
    """One Trn2 logical core's memory, capped by what the host can give."""
    available = available_memory()
    return TRN2_LOGICAL_CORE_MEMORY if available is None else min(TRN2_LOGICAL_CORE_MEMORY, available)


def reference_device_settings() -> ReferenceDeviceSettings:
    """Reads and validates every environment variable of the reference device.

    Raises:
        ConfigurationError: a variable with a value the device cannot use (named in the message).
    """
    memory_text = os.environ.get(DEVICE_MEMORY_ENV)
    device_count = _count(DEVICE_COUNT_ENV) or _count(LOCAL_WORLD_SIZE_ENV) or 1
    default_device = 0
    if os.environ.get(LOCAL_RANK_ENV, "").strip():
        rank_text = os.environ[LOCAL_RANK_ENV]
        if not rank_text.strip().isdigit() or int(rank_text) >= device_count:
            raise ConfigurationError(
                f"{LOCAL_RANK_ENV}={rank_text!r} names no device of this process's {device_count} neuron device(s) "
                f"(from {DEVICE_COUNT_ENV if os.environ.get(DEVICE_COUNT_ENV) else LOCAL_WORLD_SIZE_ENV}): each "
                f"local rank uses the device of its number; unset {DEVICE_COUNT_ENV} under a launcher."
            )
        default_device = int(rank_text)
    return ReferenceDeviceSettings(
        device_memory=parse_bytes(memory_text) if memory_text else default_device_memory(),
        device_count=device_count,
        profile=os.environ.get(PROFILE_ENV, "").strip() or PROFILES[0],
        fallback_copies=parse_flag(FALLBACK_COPY_ENV),
        default_device=default_device,
    )


def _count(name: str) -> int | None:
    """A device count from the environment variable `name`: 1 to MAX_DEVICE_COUNT (None when unset)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or not 1 <= int(text) <= MAX_DEVICE_COUNT:
        raise ConfigurationError(f"{name}={text!r} must be a whole number from 1 to {MAX_DEVICE_COUNT}.")
    return int(text)
