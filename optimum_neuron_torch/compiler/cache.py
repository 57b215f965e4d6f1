"""The persistent cache of compiled graphs: one directory per entry, found by a key that hashes
everything the compiled code depends on.

An entry is built in a private temporary directory and renamed into place, under a lock per key:
two processes compiling the same graph at once both succeed and leave one valid entry (the
second finds the first's), and an interrupted or failed compile leaves nothing that blocks a
retry. Entries are sharded by key prefix (`ab/cd/abcd...`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..settings import compile_cache_dir
from ..staging import build_once

METADATA = "entry.json"


@dataclass
class CacheStats:
    """What this process got from the cache: hits, misses (compiles) and the seconds they took;
    `uncached`, the misses whose graph could not be stored (compiled again in each process)."""

    hits: int = 0
    misses: int = 0
    uncached: int = 0
    compile_seconds: float = 0.0
    load_seconds: float = 0.0


STATS = CacheStats()


def cache_stats() -> CacheStats:
    """A copy of this process's counters."""
    return dataclasses.replace(STATS)


def reset_cache_stats() -> None:
    """Sets this process's counters back to zero."""
    for field in dataclasses.fields(STATS):
        setattr(STATS, field.name, field.default)


@dataclass(frozen=True)
class Entry:
    """One compiled graph on disk."""

    key: str
    path: Path
    metadata: dict[str, Any]

    @property
    def size(self) -> int:
        return sum(file.stat().st_size for file in self.path.rglob("*") if file.is_file())


def _describe(value: Any) -> str:
    if isinstance(value, DeviceMesh):
        # DTensor's ops are lowered for this rank's place in the mesh (an embedding split by
        # vocabulary masks this rank's range): each rank's compiled graph is its own.
        return f"{value!r} at {value.get_coordinate()}"
    if isinstance(value, torch.Tensor):
        return (f"tensor({tuple(value.shape)}, {tuple(value.stride())}, {value.dtype}, {value.device.type}, "
                f"{value.requires_grad})")
    return repr(value)


def _without_current_device_index(code: str) -> str:
    """The graph's code with the current device's index taken out. The compiled code allocates on
    the current device (Inductor writes `device='neuron'`), as a NEFF runs on the core that loads
    it: the ranks of a job, each on its own device, compile the same graph, and keep it once."""
    current = f"device(type='neuron', index={torch.neuron.current_device()})"
    return code.replace(current, "device(type='neuron')")


def graph_key(gm: torch.fx.GraphModule, example_inputs: list[Any], environment: dict[str, str],
              options: dict[str, Any]) -> str:
    """The key of a graph: its code, its constants, its inputs' shapes, strides, dtypes and whether
    they require gradients, the grad mode, the environment (versions, compiler, CPU features) and
    the compile options."""
    digest = hashlib.sha256()
    digest.update(_without_current_device_index(gm.code).encode())
    for name, tensor in sorted((*gm.named_parameters(), *gm.named_buffers())):
        digest.update(f"{name}:{_describe(tensor)}".encode())
        if tensor.device.type != "meta":
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    for value in example_inputs:
        digest.update(_describe(value).encode())
    # AOTAutograd compiles a training graph (with its backward) only under grad mode: a graph first
    # compiled under torch.no_grad() must not be what a training step gets.
    digest.update(f"grad_enabled={torch.is_grad_enabled()}".encode())
    digest.update(json.dumps(environment, sort_keys=True).encode())
    digest.update(json.dumps(options, sort_keys=True, default=repr).encode())
    return digest.hexdigest()


class CompileCache:
    """The entries under one root directory."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else compile_cache_dir()

    def path(self, key: str) -> Path:
        return self.root / key[:2] / key[2:4] / key

    def get(self, key: str) -> Entry | None:
        """The complete entry for `key`, or None."""
        path = self.path(key)
        try:
            metadata = json.loads((path / METADATA).read_text())
        except (OSError, ValueError):
            return None
        return Entry(key, path, metadata)

    def get_or_build(self, key: str, build: Callable[[Path], dict[str, Any]]) -> tuple[Entry, bool]:
        """The entry for `key`, built by `build(folder)` when missing; also says whether it was
        built here. `build` fills a fresh folder and returns the entry's metadata."""
        entry = self.get(key)
        if entry is not None:  # the usual case, every cached graph: one read of the metadata
            return entry, False

        def build_entry(folder: Path) -> None:
            metadata = {"key": key, "created": time.time(), **build(folder)}
            (folder / METADATA).write_text(json.dumps(metadata, indent=1, sort_keys=True))

        built = build_once(self.path(key), build_entry, lock=self.root / "locks" / f"{key}.lock",
                           staging_parent=self.root / "tmp", is_complete=lambda folder: self.get(key) is not None)
        return self.get(key), built

    def add(self, source: Path) -> Entry:
        """Copies an entry folder (e.g. one shipped with a saved model) into the cache."""
        metadata = json.loads((Path(source) / METADATA).read_text())

        def copy(folder: Path) -> dict[str, Any]:
            shutil.copytree(source, folder, dirs_exist_ok=True)
            return {name: value for name, value in metadata.items() if name not in ("key", "created")}

        entry, _ = self.get_or_build(metadata["key"], copy)
        return entry

    def entries(self) -> Iterator[Entry]:
        """Every complete entry, oldest first."""
        found = (self.get(path.parent.name) for path in self.root.glob(f"??/??/*/{METADATA}"))
        yield from sorted((entry for entry in found if entry is not None), key=lambda entry: entry.metadata["created"])

    def clear(self) -> int:
        """Removes every entry and leftover temporary folder; returns how many entries were removed."""
        removed = 0
        for entry in list(self.entries()):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
        shutil.rmtree(self.root / "tmp", ignore_errors=True)
        return removed

