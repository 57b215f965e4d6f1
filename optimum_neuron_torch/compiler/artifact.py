"""A compiled graph as a self-contained folder: Inductor's serialized graph (`standalone_compile`)
plus the C++ kernels it loads, so that loading it in another process, or on another machine with
the same environment, compiles nothing."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..device import backend_info
from ..errors import LoweringError, UncacheableGraph, first_line
from ..host import compiler_version
from ..settings import compile_cache_dir
from . import stablehlo
from .cache import KERNEL_BUILDS_DIR, SLOTS_DIR, write_atomically

GRAPH_FILE = "graph.bin"
LOWERS = "ok"  # the StableHLO status of a graph that lowers; otherwise the error, or why it was not checked
NOT_CHECKED = "not checked"
KERNELS_DIR = "kernels"
STABLEHLO_FILE = "graph.stablehlo.mlir"


@functools.cache
def compile_environment() -> dict[str, str]:
    """Everything a compiled graph depends on besides the graph itself, and nothing more, so that a
    graph compiled on one machine serves every machine where it would compile the same: PyTorch's
    version (its serialization), Python's bytecode version (not its patch release), the backend; on
    TorchNeuron its version (its own cache keys cover its compiler); on the reference device the
    library's code generation (not its version: a release that leaves it alone keeps every graph),
    the C++ compiler, what `-march=native` (Inductor's default) makes of this CPU and Torch-MLIR's
    version (if the `stablehlo` extra is installed)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    info = backend_info()
    found = {
        "torch": torch.__version__,
        "backend": info.name,
        "python": sys.implementation.cache_tag,
        "platform": sys.platform,
    }
    if info.compiles_itself:  # (its version names its compiler; its own cache keys cover the rest)
        return {**found, info.name: info.version}
    compiler = get_cpp_compiler()
    return {
        **found,
        "codegen": _codegen_digest(),
        "compiler": compiler_version(compiler),
        "cpu": f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()} target {_native_target(compiler)}",
        # (an entry records whether its graph lowers to StableHLO, which the partitioning reads)
        "torch_mlir": stablehlo.version() or "not installed",
    }


def _codegen_digest() -> str:
    """A short hash of the library's code that shapes a compiled graph on the reference device: the
    Inductor device it registers, this module (how graphs are compiled and stored) and the StableHLO
    check (whose verdict an entry records)."""
    from . import inductor_device

    digest = hashlib.sha256()
    for module in (inductor_device.__file__, __file__, stablehlo.__file__):
        digest.update(Path(module).read_bytes())
    return digest.hexdigest()[:12]


def _native_target(compiler: str) -> str:
    """A short hash of the instruction sets the C++ compiler enables for `-march=native` on this CPU
    (the kernels are built with it): two CPUs that differ only in flags no code uses (a hypervisor's,
    a microcode mitigation's) give the same. Compilers that cannot list them (`-Q --help=target` is
    GCC's) fall back to every feature flag of the CPU."""
    try:
        listed = subprocess.run([compiler, "-march=native", "-Q", "--help=target"], capture_output=True, text=True,
                                check=True, timeout=60).stdout
        enabled = sorted(" ".join(line.split()) for line in listed.splitlines()
                         if line.strip().endswith("[enabled]") or line.strip().startswith("-march="))
    except (OSError, subprocess.SubprocessError):
        enabled = []
    if not enabled:
        try:
            with open("/proc/cpuinfo") as cpuinfo:
                flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
        except OSError:
            flags = platform.processor()
        enabled = sorted(flags.split(":", 1)[-1].split())
    return hashlib.sha256(" ".join(enabled).encode()).hexdigest()[:12]


def _probe_vector_isa() -> None:
    """Lets Inductor probe, outside an entry's kernel folder, which vector instruction sets the host
    compiler and CPU support. It probes by building a small library per set in its cache and loading
    each in a subprocess, once per process: probed in an entry's folder, the libraries are built
    again by every process, about 7 s on 2 cores before the first graph loads; probed in its shared
    cache, built once per machine, but still about 0.8 s of subprocesses in every process. So the
    sets found are recorded in the compile cache under the compile environment's digest (a machine
    with the same compiler and CPU finds the same), and a process finding the record takes the sets
    the CPU lists as they are (Inductor's `cpp.vec_isa_ok` setting) when the record says all of them
    passed; otherwise (no record, or a set failed its probe) Inductor probes."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    if valid_vec_isa_list.cache_info().currsize:  # (probed already in this process)
        return
    record = compile_cache_dir() / SLOTS_DIR / f"vector-isa-{_environment_digest()}.json"
    with config.patch({"cpp.vec_isa_ok": True}):
        listed = [str(isa) for isa in valid_vec_isa_list.__wrapped__()]  # (the CPU's, unprobed)
    try:
        recorded = json.loads(record.read_text())
    except (OSError, ValueError):
        recorded = None
    if recorded == listed:
        with config.patch({"cpp.vec_isa_ok": True}):
            valid_vec_isa_list()
        return
    write_atomically(record, json.dumps([str(isa) for isa in valid_vec_isa_list()]))


def _environment_digest() -> str:
    return hashlib.sha256(json.dumps(compile_environment(), sort_keys=True).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _inductor_cache_in(folder: Path) -> Iterator[None]:
    """Points Inductor's cache at `folder` (its documented `TORCHINDUCTOR_CACHE_DIR`): the folder
    shared by every compile (see `_kernels_built_once`), or an entry's own folder, whose kernels a
    load finds there. Inductor's probe of the CPU's vector instruction sets runs first, in its own
    cache (see `_probe_vector_isa`)."""
    _probe_vector_isa()
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def compile_into(gm: torch.fx.GraphModule, example_inputs: list[Any], folder: Path, options: dict[str, Any],
                 *, strict_lowering: bool = False, lowering_failure: str | None = None) -> dict[str, Any]:
    """Compiles `gm` with Inductor's C++ code generation for the device into `folder`; returns
    what the entry records about it. With `strict_lowering`, a graph that does not lower to
    StableHLO raises `LoweringError` before anything is compiled (the backend then splits it).
    `lowering_failure`, when the caller already knows the graph does not lower, is that error
    (lowering the graph again would only repeat it, at the cost of the slowest step of a compile)."""
    from torch._inductor import standalone_compile

    from .inductor_device import host_memory_codegen, register

    metadata: dict[str, Any] = {}
    if stablehlo.available():
        metadata["stablehlo"] = _lower_to_stablehlo(gm, example_inputs, folder, strict_lowering, lowering_failure)
    register()
    start = time.perf_counter()
    with host_memory_codegen(), _kernels_built_once(folder / KERNELS_DIR):
        compiled = standalone_compile(
            gm, example_inputs, dynamic_shapes="from_example_inputs", aot=True,
            options={"config_patches": options} if options else None,
        )
    try:
        serialized = compiled.serialize()
    except Exception as error:  # AOTAutograd bypassed its cache for this graph: nothing to serialize
        raise UncacheableGraph(compiled, f"{type(error).__name__}: {first_line(error)}") from error
    (folder / GRAPH_FILE).write_bytes(serialized)
    metadata["compile_seconds"] = round(time.perf_counter() - start, 3)
    return metadata


# The kernel libraries of the entries this process loaded, by file name (a hash of the kernel's source).
_kernel_libraries: dict[str, Path] = {}


@contextlib.contextmanager
def _kernels_built_once(kernels: Path) -> Iterator[None]:
    """Inside the block, Inductor builds C++ kernels in one folder of the compile cache shared by every
    process of the compile environment (`KERNEL_BUILDS_DIR`); at its end, the sources and libraries of
    the kernels the graph loads are put in `kernels`, the entry's own folder, which `load` reads (an
    entry stays whole: it can be copied to another machine alone). So a kernel is built once (about a
    second on 2 cores), whichever graph, process or rank needs it: the ranks of a tensor-parallel job
    compile graphs differing by a few constants (their share of the vocabulary) at the same time, and
    Inductor's lock on the shared folder lets one of them build each common kernel while the others
    wait for it (2 ranks of a tiny Llama: 13 of the 14 kernels of a prefill graph are the same). A
    kernel this process loaded earlier is taken from memory: its library comes from the entry it was
    loaded from. The sources are noted as Inductor writes them (`codecache.write`, the one place
    every kernel's source goes through, found or not)."""
    from torch._inductor import codecache

    shared = compile_cache_dir() / KERNEL_BUILDS_DIR / _environment_digest()
    sources: list[Path] = []
    write = codecache.write

    def noting_write(*args: Any, **kwargs: Any) -> tuple[str, str]:
        key, path = write(*args, **kwargs)
        if path.endswith(".main.cpp"):
            sources.append(Path(path))
        return key, path

    codecache.write = noting_write
    try:
        with _inductor_cache_in(shared):
            yield
    finally:
        codecache.write = write
    for source in sources:
        library = source.with_suffix(".so")
        built = _kernel_libraries.get(library.name)
        if built is not None and built.is_file():  # (taken from memory: the shared folder gets it for later)
            _link(built, library)
        else:  # (built or found there: Inductor waits for the lock of a library another process builds)
            built = library
        for found in (source, built):
            if found.is_file():
                _link(found, kernels / found.parent.name / found.name)
        # (and the lock Inductor takes to load it: a load writes nothing, so a read-only cache serves)
        (kernels / "locks").mkdir(parents=True, exist_ok=True)
        (kernels / "locks" / f"{source.name.removesuffix('.main.cpp')}.lock").touch()


def _link(source: Path, target: Path) -> None:
    """`target` made the same file as `source` (a copy across file systems); left alone if it exists."""
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except FileExistsError:  # (another process linked it first)
        pass
    except OSError:  # (another file system)
        shutil.copy2(source, target)


def _lower_to_stablehlo(gm: torch.fx.GraphModule, example_inputs: list[Any], folder: Path, strict: bool,
                        known_failure: str | None = None) -> str:
    """Writes the graph's StableHLO next to it; returns "ok", or the error (with a warning, or
    raised as `LoweringError` when `strict`). A graph that calls collectives is not checked: they
    have no Torch-MLIR lowering, and TorchNeuron lowers them itself."""
    called = stablehlo.collectives(gm)
    if called:
        return f"{NOT_CHECKED}: the graph calls collectives ({', '.join(called)}), which TorchNeuron lowers itself"
    message = known_failure
    if message is None:
        try:
            (folder / STABLEHLO_FILE).write_text(stablehlo.lower(gm, example_inputs))
            return LOWERS
        except Exception as error:  # any failure of the check is its result, never a failed compile
            message = f"{type(error).__name__}: {first_line(error)}"
            if strict:
                raise LoweringError(message) from error
    if strict:
        raise LoweringError(message)
    warnings.warn(f"This graph does not lower to StableHLO, so TorchNeuron could not compile it ({message}). "
                  "It runs on the reference device.", stacklevel=2)
    return message


def lowering_failed(status: str) -> bool:
    """Whether a graph's recorded StableHLO status says it does not lower (a graph that was not
    checked, one that calls collectives, has not failed)."""
    return status != LOWERS and not status.startswith(NOT_CHECKED)


def load(folder: Path) -> Callable[..., Any]:
    """The compiled graph stored in `folder`, ready to call."""
    from torch._inductor.standalone_compile import AOTCompiledArtifact

    _kernel_libraries.update((library.name, library) for library in (folder / KERNELS_DIR).rglob("*.so"))
    with _inductor_cache_in(folder / KERNELS_DIR):
        return AOTCompiledArtifact.deserialize((folder / GRAPH_FILE).read_bytes())
