"""The persistent cache of compiled graphs: one directory per entry, found by a key that hashes
everything the compiled code depends on.

An entry is built in a private temporary directory and renamed into place, under a lock per key:
two processes compiling the same graph at once both succeed and leave one valid entry (the
second finds the first's), and an interrupted or failed compile leaves nothing that blocks a
retry. Entries are sharded by key prefix (`ab/cd/abcd...`).

Keys hold no path, user or host: a graph is identified by its code, its inputs' layout and the
environment it was compiled in (see `graph_key`), so entries can be copied between machines and
folders (`compiler.remote`). Each entry records the SHA-256 of its files; an entry whose files do
not match (truncated, tampered with) is never loaded: it is removed, with a warning naming it, and
the graph is compiled again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..errors import CompileCacheError
from ..settings import compile_cache_dir
from ..staging import build_once

METADATA = "entry.json"
CHECKSUMS = "files"  # the metadata field holding {relative path: SHA-256} of each file of the entry


@dataclass
class CacheStats:
    """What this process got from the cache: hits, misses (compiles) and the seconds they took;
    `uncached`, the misses whose graph could not be stored (compiled again in each process);
    `traced`, the compiled functions Dynamo traced (and saved), `restored`, those loaded instead
    of traced (see `precompiled`)."""

    hits: int = 0
    misses: int = 0
    uncached: int = 0
    traced: int = 0
    restored: int = 0
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


FUNCTION_KIND = "compiled function"  # the `kind` of an entry holding a traced function (see `precompiled`)
SLOTS_DIR = "warm-starts"  # (beside the entries: which function was saved last for each call, see `precompiled`)
KERNEL_BUILDS_DIR = "kernel-builds"  # (Inductor's cache while compiling: each kernel built once, see `artifact`)


@dataclass(frozen=True)
class Entry:
    """One compiled graph on disk, or one compiled function (a traced function saved for warm
    starts, see `precompiled`: its `kind` is `FUNCTION_KIND`)."""

    key: str
    path: Path
    metadata: dict[str, Any]

    @property
    def is_function(self) -> bool:
        return self.metadata.get("kind") == FUNCTION_KIND

    @property
    def size(self) -> int:
        return sum(file.stat().st_size for file in self.path.rglob("*") if file.is_file())


def write_atomically(path: Path, text: str) -> None:
    """Writes `text` to `path` under a temporary name, then renames it: a reader finds the old file or the new one,
    never part of one (two processes may write the same note at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_suffix(f".{os.getpid()}.tmp")
    staged.write_text(text)
    os.replace(staged, path)


def file_digest(path: Path) -> str:
    """The SHA-256 of a file, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_checksums(folder: Path) -> dict[str, str]:
    """{path relative to `folder`: SHA-256} of every file in it but the metadata."""
    return {file.relative_to(folder).as_posix(): file_digest(file) for file in sorted(folder.rglob("*"))
            if file.is_file() and file.relative_to(folder).as_posix() != METADATA}


def entry_problem(folder: Path, metadata: dict[str, Any]) -> str | None:
    """Why the entry in `folder` must not be loaded (a file missing, or not the one recorded), or None.
    Files added since (Inductor may add lock files when it loads kernels) are not a problem."""
    recorded = metadata.get(CHECKSUMS)
    if not isinstance(recorded, dict):
        return "it records no checksums of its files (written by an older version of the library)"
    for name, expected in sorted(recorded.items()):
        path = folder / name
        if not path.is_file():
            return f"its file {name} is missing"
        if file_digest(path) != expected:
            return f"its file {name} is not the one compiled (SHA-256 differs: truncated or modified)"
    return None


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


def autocast_state() -> str:
    """Whether autocast is on, and to which dtype, for the device and the CPU. The dtype of an autocast
    that is off changes nothing traced, and is thread-local: a thread torch starts has the default."""
    states = []
    for device in ("neuron", "cpu"):
        try:
            on = torch.is_autocast_enabled(device)
            states.append(f"{device}:{torch.get_autocast_dtype(device) if on else 'off'}")
        except RuntimeError:  # (a device type autocast does not know)
            states.append(f"{device}:unknown")
    return "autocast=" + ",".join(states)


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
    # Likewise autocast: under an autocast the caller entered (Trainer's bf16) AOTAutograd traces the casts into
    # the graph, whose Dynamo code is the same as without it: a float32 graph must not serve a bf16 step.
    digest.update(autocast_state().encode())
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
        """The entry for `key`, built by `build(folder)` when missing, or when the entry found does
        not match its checksums (then removed, with a warning naming it); also says whether it was
        built here. `build` fills a fresh folder and returns the entry's metadata."""
        entry = self.get(key)
        if entry is not None:  # the usual case, every cached graph: its files checked against their checksums
            problem = entry_problem(entry.path, entry.metadata)
            if problem is None:
                return entry, False
            self.discard(key, problem)

        def build_entry(folder: Path) -> None:
            metadata = {"key": key, "created": time.time(), **build(folder)}
            metadata[CHECKSUMS] = folder_checksums(folder)
            (folder / METADATA).write_text(json.dumps(metadata, indent=1, sort_keys=True))

        built = build_once(self.path(key), build_entry, lock=self.root / "locks" / f"{key}.lock",
                           staging_parent=self.root / "tmp", is_complete=lambda folder: self.get(key) is not None)
        return self.get(key), built

    def discard(self, key: str, reason: str) -> None:
        """Removes the entry of `key`, which must not be loaded because of `reason`, with a warning
        naming it. (Renamed away first: a process that looks meanwhile finds no entry, never half a one.)"""
        warnings.warn(f"Compile cache entry {key} in {self.root} is not loaded: {reason}. Its graph is compiled "
                      "again.", stacklevel=3)
        trash = self.root / "tmp" / f".discarded.{key}.{uuid.uuid4().hex[:8]}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(self.path(key), trash)
        except OSError:  # (already removed by another process)
            return
        shutil.rmtree(trash, ignore_errors=True)

    def add(self, source: Path) -> Entry:
        """Copies an entry folder (e.g. one shipped with a saved model, or pulled from a remote) into
        the cache; an entry of this key already there is kept.

        Raises:
            CompileCacheError: the folder's files do not match the checksums it records (named).
        """
        metadata = json.loads((Path(source) / METADATA).read_text())
        problem = entry_problem(Path(source), metadata)
        if problem is not None:
            raise CompileCacheError(f"compiled graph {metadata.get('key')} in {source} cannot be added to the compile "
                                    f"cache: {problem}.")

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
        shutil.rmtree(self.root / SLOTS_DIR, ignore_errors=True)
        shutil.rmtree(self.root / KERNEL_BUILDS_DIR, ignore_errors=True)
        return removed

