"""The stand-in's NEFF cache: TorchNeuron's persistent cache layout, an in-process layer, and the keys
MegaCache collects.

A "NEFF" here is the graph's code (`gm.code`), stored at
`$TORCH_NEURONX_NEFF_CACHE_DIR/<k[0:2]>/<k[2:4]>/<k>.neff` (default /tmp/neff_cache);
TORCH_NEURONX_NEFF_DISABLE_CACHE=1 (or true/yes) turns the persistent layer off, as in TorchNeuron.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

CACHE_DIR_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
DISABLE_ENV = "TORCH_NEURONX_NEFF_DISABLE_CACHE"
DEFAULT_CACHE_DIR = "/tmp/neff_cache"

_lock = threading.Lock()
_memory: dict[str, bytes] = {}  # TorchNeuron's in-memory compilation cache
_tracked: set[str] = set()  # keys compiled or hit since MegaCache last collected them


def persistent() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("1", "true", "yes")


def path_for(key: str) -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV, DEFAULT_CACHE_DIR)) / key[0:2] / key[2:4] / f"{key}.neff"


def get(key: str) -> bytes | None:
    """The NEFF of `key` from memory, else from the persistent cache; None when absent."""
    with _lock:
        if key in _memory:
            return _memory[key]
    if persistent():
        try:
            content = path_for(key).read_bytes()
        except OSError:
            return None
        with _lock:
            _memory[key] = content
        return content
    return None


def put(key: str, content: bytes) -> bool:
    """Stores a NEFF in memory and, when enabled, atomically on disk. False when the disk write failed."""
    with _lock:
        _memory[key] = content
    if not persistent():
        return True
    path = path_for(key)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(content)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True


def track(key: str) -> None:
    with _lock:
        _tracked.add(key)


def take_tracked() -> list[str]:
    """The keys to hand to MegaCache, forgotten once taken (so the set does not grow forever)."""
    with _lock:
        keys = sorted(_tracked)
        _tracked.clear()
    return keys
