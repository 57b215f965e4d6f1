"""JIT build of the reference device's C++ extension, cached on disk.

The build directory is keyed by the torch version, the C++ compiler and a hash of the sources,
so a cached build is reused only when all three match; loading one takes milliseconds.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
from filelock import FileLock

from ...errors import ReferenceDeviceBuildError
from ...host import compiler_version
from ...settings import cache_dir, cxx_compiler

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
# OpenMP: the decode kernels split their work with `at::parallel_for`, whose OpenMP backend is inline
# in ATen's headers (without the flag it runs on one thread); it links to the libgomp torch loaded.
CFLAGS = ["-O2", "-fopenmp"]


def _compiler() -> str:
    compiler = cxx_compiler()
    if shutil.which(compiler) is None:
        raise ReferenceDeviceBuildError(
            f"no C++ compiler found (looked for {compiler!r}): the reference neuron device is a C++ "
            "extension built on first use. Install one (e.g. `apt-get install g++`) or point CXX at it."
        )
    return compiler


def build_key(compiler: str) -> str:
    """Hash of everything the binary depends on."""
    digest = hashlib.sha256()
    for part in (torch.__version__, compiler_version(compiler), " ".join(CFLAGS), sys.version):
        digest.update(part.encode())
    for source in sorted(SOURCE_DIR.iterdir()):
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def _import_built(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path,
                                                  loader=importlib.machinery.ExtensionFileLoader(name, str(path)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_extension() -> ModuleType:
    """Returns the compiled extension, building it first when no matching build is cached."""
    compiler = _compiler()
    key = build_key(compiler)
    name = f"optimum_neuron_torch_reference_{key}"
    build_dir = cache_dir() / "extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    # One process builds while the others wait: a half-written library must never be loaded.
    with FileLock(str(build_dir) + ".lock"):
        library = build_dir / f"{name}.so"
        if library.exists():
            return _import_built(name, library)
        return _build(name, build_dir)


def _build(name: str, build_dir: Path) -> ModuleType:
    from torch.utils import cpp_extension

    sources = sorted(str(path) for path in SOURCE_DIR.glob("*.cpp"))
    message = ("optimum-neuron-torch: building the reference neuron device "
               f"(once per torch version and compiler; about a minute) in {build_dir}")
    logger.warning(message)
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=name, sources=sources, build_directory=str(build_dir), extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"], verbose=False
        )
    except (RuntimeError, subprocess.CalledProcessError, OSError) as error:
        raise ReferenceDeviceBuildError(
            f"building the reference neuron device failed in {build_dir}: {error}. Make sure g++ and ninja "
            "are installed and that torch is the version this package was tested with."
        ) from error
    logger.warning("optimum-neuron-torch: reference neuron device built in %.0f s", time.perf_counter() - start)
    return module
