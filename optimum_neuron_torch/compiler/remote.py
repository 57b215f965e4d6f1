"""Compiled graphs shared between machines: `cache push DEST` and `cache pull SRC`.

A remote is a local folder, any fsspec URL (`s3://bucket/prefix`, `file:///...`), or a Hugging Face
Hub repo through `huggingface_hub`'s file system (`hf://org/repo`, `hf://datasets/org/repo`; pull
from `hf://org/repo@<commit>` to pin a revision). It holds, under `neuron-compile-cache/v1/`:

    blobs/<sha256>.tar               one entry, archived; named by its own SHA-256 (content-addressed)
    entries/<kind>/<name>.json       {"key", "sha256", "size", "environment", ...}: which blob is the entry

`kind` is `graph` for the reference device's compile-cache entries (named by their key, which holds
no path, user or host: see `cache.graph_key`) and `neff` for TorchNeuron's NEFF cache files (named by
their path in that cache): each backend pushes and pulls its own. A blob is written before its record,
each under a temporary name then renamed (on a local folder; one upload elsewhere), and a record
already at the remote is never replaced: pushes that run at once, or stop half-way, leave a remote
whose every record names a complete blob. A pull checks each blob against its SHA-256, and each
entry against the environment it was compiled in, before anything reaches the local cache; an
entry that fails is named with the reason, skipped, and its graph is compiled when it is needed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..device import backend_info
from ..errors import CompileCacheError, MissingDependencyError, first_line
from ..settings import neff_cache_dir
from .artifact import compile_environment
from .cache import METADATA, CompileCache, entry_problem

LAYOUT = "neuron-compile-cache/v1"
GRAPH, NEFF = "graph", "neff"
# Where a pulled NEFF is unpacked inside TorchNeuron's NEFF cache before it moves in (the same file
# system); a push running at the same time skips it, as it skips `.tmp` and `.lock` files.
STAGING = ".optimum-neuron-torch-staging/"


@dataclass
class TransferReport:
    """What a push or a pull did: entries copied, entries already there, and the entries skipped
    (each with the reason, which names it)."""

    copied: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def summary(self, verb: str, where: str) -> str:
        return (f"{verb} {len(self.copied)} compiled graphs ({len(self.present)} already there, "
                f"{len(self.skipped)} skipped): {where}")


def _file_system(url: str) -> tuple[Any, str]:
    """The fsspec file system of `url` and the path in it (a plain path is a local folder)."""
    try:
        import fsspec
    except ImportError as error:  # (a dependency of huggingface_hub: only a broken install lacks it)
        raise MissingDependencyError("cache push/pull needs fsspec: pip install fsspec") from error
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as error:
        raise CompileCacheError(f"cannot open the cache remote {url}: {first_line(error)}") from error
    return fs, path.rstrip("/")


def _is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _write(fs: Any, path: str, data: bytes) -> None:
    """Writes `data` at `path`, never leaving part of it there: on a local folder under a temporary
    name then renamed; elsewhere in one upload (an object store's or the Hub's writes are whole)."""
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    if not _is_local(fs):
        fs.pipe_file(path, data)
        return
    temporary = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with fs.open(temporary, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    finally:
        if fs.exists(temporary):
            fs.rm(temporary)


# Local entries: what this backend pushes --------------------------------------------------------
@dataclass(frozen=True)
class _Local:
    kind: str
    name: str  # the record's name: a graph's key, or a NEFF file's path in TorchNeuron's cache
    folder: Path  # what the blob archives: the entry's folder, or the folder holding the NEFF file
    members: tuple[str, ...]  # the archived paths, relative to `folder`


def _local_entries(cache: CompileCache) -> Iterator[_Local]:
    """The entries this backend compiled: the compile cache's (on TorchNeuron, which compiles through
    its own cache, the compiled functions saved for warm starts only), and on TorchNeuron the NEFF
    cache's files."""
    root = backend_info().neff_cache
    if root is not None:
        for path in sorted(root.rglob("*")) if root.is_dir() else ():
            name = path.relative_to(root).as_posix()
            if path.is_file() and not path.name.endswith((".tmp", ".lock")) and not name.startswith(STAGING):
                yield _Local(NEFF, name, root, (name,))
    backend = compile_environment()["backend"]
    for entry in cache.entries():
        if entry.metadata.get("environment", {}).get("backend") != backend:  # (another backend's, e.g. a test's)
            continue
        members = tuple(file.relative_to(entry.path).as_posix() for file in sorted(entry.path.rglob("*"))
                        if file.is_file())
        yield _Local(GRAPH, entry.key, entry.path, members)


def _archive(local: _Local) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for member in local.members:
            info = archive.gettarinfo(str(local.folder / member), arcname=member)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with open(local.folder / member, "rb") as file:
                archive.addfile(info, file)
    return buffer.getvalue()


def _record_path(root: str, kind: str, name: str) -> str:
    # (a NEFF's path in its cache may hold folders: flattened, hashed, into one record name)
    stem = name if kind == GRAPH else hashlib.sha256(name.encode()).hexdigest()
    return f"{root}/{LAYOUT}/entries/{kind}/{stem}.json"


def _blob_path(root: str, digest: str) -> str:
    return f"{root}/{LAYOUT}/blobs/{digest}.tar"


def push(destination: str, cache: CompileCache | None = None) -> TransferReport:
    """Copies every compiled graph of this backend's cache to `destination` (see the module's
    docstring for the layout); entries already there are kept as they are.

    Args:
        destination: a local folder, an fsspec URL or `hf://[datasets/]org/repo`.
        cache: the compile cache to read (default: this process's).

    Returns:
        The entries copied and those already at the destination.

    Raises:
        CompileCacheError: the destination cannot be written (named); the local cache is only read.

    Example:
        >>> push("/shared/neuron-cache")  # then, on another machine: pull("/shared/neuron-cache")
    """
    cache = cache or CompileCache()
    fs, root = _file_system(destination)
    report = TransferReport()
    environment = compile_environment()
    try:
        for local in _local_entries(cache):
            record_path = _record_path(root, local.kind, local.name)
            if fs.exists(record_path):
                report.present.append(local.name)
                continue
            blob = _archive(local)
            digest = hashlib.sha256(blob).hexdigest()
            if not fs.exists(_blob_path(root, digest)):
                _write(fs, _blob_path(root, digest), blob)
            record = {"kind": local.kind, "name": local.name, "sha256": digest, "size": len(blob),
                      "environment": environment}
            _write(fs, record_path, json.dumps(record, indent=1, sort_keys=True).encode())
            report.copied.append(local.name)
    except OSError as error:
        raise CompileCacheError(f"cannot push compiled graphs to {destination}: {type(error).__name__}: "
                                f"{first_line(error)}") from error
    return report


def _environment_difference(recorded: Any, here: dict[str, str]) -> str | None:
    """How the environment an entry was compiled in differs from this one, or None."""
    if not isinstance(recorded, dict):
        return "it records no environment"
    differences = [f"{name} {recorded.get(name)!r} (here {value!r})" for name, value in sorted(here.items())
                   if recorded.get(name) != value]
    return "compiled for another environment: " + ", ".join(differences) if differences else None


def pull(source: str, cache: CompileCache | None = None) -> TransferReport:
    """Copies the compiled graphs at `source` that this backend and environment can use into the
    local cache. Each blob is checked against its SHA-256 and each entry against its environment
    and file checksums first; an entry that fails is skipped, with the reason naming it, and never
    replaces a local one.

    Args:
        source: a local folder, an fsspec URL or `hf://[datasets/]org/repo[@revision]`.
        cache: the compile cache to fill (default: this process's).

    Returns:
        The entries copied, those already in the local cache, and those skipped (with why).

    Raises:
        CompileCacheError: `source` cannot be read, or holds no cache (named).
    """
    cache = cache or CompileCache()
    fs, root = _file_system(source)
    kinds = (NEFF, GRAPH) if backend_info().neff_cache is not None else (GRAPH,)
    here = compile_environment()
    report = TransferReport()
    try:
        if not fs.isdir(f"{root}/{LAYOUT}"):
            raise CompileCacheError(f"{source} holds no compiled graphs (no {LAYOUT}/ folder): push to it first.")
        records = [(kind, path) for kind in kinds
                   for path in sorted(fs.glob(f"{root}/{LAYOUT}/entries/{kind}/*.json"))]
    except OSError as error:
        raise CompileCacheError(f"cannot pull compiled graphs from {source}: {type(error).__name__}: "
                                f"{first_line(error)}") from error
    for kind, record_path in records:
        name = record_path.rsplit("/", 1)[-1].removesuffix(".json")
        try:
            record = json.loads(fs.cat_file(record_path))
            name = str(record["name"])
            if _present(cache, kind, name):
                report.present.append(name)
                continue
            problem = _environment_difference(record.get("environment"), here)
            blob = None if problem else fs.cat_file(_blob_path(root, str(record["sha256"])))
            if blob is not None and hashlib.sha256(blob).hexdigest() != record["sha256"]:
                problem = f"its archive's SHA-256 differs from the one recorded (damaged at {source})"
            if problem is None:
                problem = _install(cache, kind, name, blob)
        except (OSError, ValueError, KeyError, TypeError) as error:  # (this entry's, not the whole pull's)
            problem = f"its record or archive cannot be read ({type(error).__name__}: {first_line(error)})"
        if problem is None:
            report.copied.append(name)
        else:
            report.skipped.append(f"{kind} {name}: {problem}")
    return report


def _present(cache: CompileCache, kind: str, name: str) -> bool:
    if kind == NEFF:
        return (neff_cache_dir() / name).is_file()
    entry = cache.get(name)
    return entry is not None and entry_problem(entry.path, entry.metadata) is None


def _install(cache: CompileCache, kind: str, name: str, blob: bytes) -> str | None:
    """Unpacks a checked blob into the local cache; returns why it could not be, or None."""
    with tempfile.TemporaryDirectory(dir=_staging_parent(cache, kind)) as staging:
        folder = Path(staging)
        try:
            with tarfile.open(fileobj=io.BytesIO(blob)) as archive:
                archive.extractall(folder, filter="data")  # (no absolute paths, links out or devices)
        except (tarfile.TarError, OSError) as error:
            return f"its archive does not unpack ({type(error).__name__}: {first_line(error)})"
        if kind == NEFF:
            return _install_neff(folder, name)
        try:
            metadata = json.loads((folder / METADATA).read_text())
        except (OSError, ValueError):
            return f"its archive holds no readable {METADATA}"
        if metadata.get("key") != name:
            return f"its archive holds the entry {metadata.get('key')!r}, not {name!r}"
        try:
            cache.add(folder)  # (checks the files against the checksums the entry records)
        except CompileCacheError as error:
            return str(error)
    return None


def _staging_parent(cache: CompileCache, kind: str) -> Path:
    """Where a pulled entry is unpacked before it moves in: beside its destination (one file system)."""
    parent = neff_cache_dir() / STAGING if kind == NEFF else cache.root / "tmp"
    parent.mkdir(parents=True, exist_ok=True)
    return parent


def _install_neff(folder: Path, name: str) -> str | None:
    source = folder / name
    if not source.is_file():
        return f"its archive does not hold {name}"
    final = neff_cache_dir() / name
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = final.with_name(f"{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        os.replace(source, temporary)
        if not final.exists():  # (a NEFF already there is kept)
            os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)
    return None

