"""Settings of the reference device, read from environment variables when it is activated."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ...errors import ConfigurationError

DEVICE_MEMORY_ENV = "OPTIMUM_NEURON_TORCH_DEVICE_MEMORY"
DEVICE_COUNT_ENV = "OPTIMUM_NEURON_TORCH_DEVICE_COUNT"
PROFILE_ENV = "OPTIMUM_NEURON_TORCH_PROFILE"
FALLBACK_ENV = "OPTIMUM_NEURON_TORCH_FALLBACK"
FALLBACK_COPY_ENV = "OPTIMUM_NEURON_TORCH_FALLBACK_COPY"
CACHE_ENV = "OPTIMUM_NEURON_TORCH_CACHE"

# One Trn2 logical NeuronCore (LNC=2) has 24 GiB of HBM.
TRN2_LOGICAL_CORE_MEMORY = 24 * 1024**3

FALLBACK_MODES = ("warn", "error", "silent")

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


@dataclass(frozen=True)
class Settings:
    """What the environment asks of the reference device."""

    device_memory: int
    device_count: int
    profile: str
    fallback: str
    fallback_copies: bool


def parse_bytes(text: str, name: str = DEVICE_MEMORY_ENV) -> int:
    """Parses `1073741824`, `24GiB`, `512 MB` and the like into a number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigurationError(f"{name}={text!r} is not a size: write bytes, or a number with a unit such as 24GiB or 512MB.")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ConfigurationError(f"{name}={text!r} must be a positive size.")
    return size


def host_available_memory() -> int | None:
    """Physical memory the host can give, from /proc/meminfo or sysconf; None when unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_device_memory() -> int:
    """One Trn2 logical core's memory, capped by what the host can give."""
    available = host_available_memory()
    return TRN2_LOGICAL_CORE_MEMORY if available is None else min(TRN2_LOGICAL_CORE_MEMORY, available)


def cache_dir() -> Path:
    """Root of this library's on-disk caches (built extensions, compiled artifacts)."""
    if CACHE_ENV in os.environ:
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return Path(xdg) / "optimum-neuron-torch"


def read_settings() -> Settings:
    """Reads and validates every environment variable of the reference device."""
    memory_text = os.environ.get(DEVICE_MEMORY_ENV)
    memory = parse_bytes(memory_text) if memory_text else default_device_memory()

    count_text = os.environ.get(DEVICE_COUNT_ENV, "1")
    if not count_text.strip().isdigit() or not 1 <= int(count_text) <= 64:
        raise ConfigurationError(f"{DEVICE_COUNT_ENV}={count_text!r} must be a whole number from 1 to 64.")

    fallback = os.environ.get(FALLBACK_ENV, "warn").strip().lower()
    if fallback not in FALLBACK_MODES:
        raise ConfigurationError(f"{FALLBACK_ENV}={fallback!r} must be one of {', '.join(FALLBACK_MODES)}.")

    copies_text = os.environ.get(FALLBACK_COPY_ENV, "0").strip().lower()
    if copies_text not in ("0", "1", "true", "false", ""):
        raise ConfigurationError(f"{FALLBACK_COPY_ENV}={copies_text!r} must be 0 or 1.")

    return Settings(
        device_memory=memory,
        device_count=int(count_text),
        profile=os.environ.get(PROFILE_ENV, "torchneuron").strip() or "torchneuron",
        fallback=fallback,
        fallback_copies=copies_text in ("1", "true"),
    )
