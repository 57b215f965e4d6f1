"""`optimum-cli neuron-torch cache list|stats|clear`: the cache of compiled graphs."""

from __future__ import annotations

from ..compiler.cache import CompileCache
from ..device import backend_info
from ..settings import neff_cache_dir


def list_cache() -> None:
    """Prints every compiled graph: key, size, compile time, first input shapes."""
    cache = CompileCache()
    entries = list(cache.entries())
    print(f"{len(entries)} compiled graphs in {cache.root}")
    for entry in entries:
        shapes = ", ".join("x".join(map(str, shape)) or "scalar"
                           for shape in entry.metadata.get("input_shapes", [])[:4])
        print(f"{entry.key[:16]}  {entry.size / 2**20:7.2f} MiB  "
              f"compiled in {entry.metadata.get('compile_seconds', 0):5.1f} s  "
              f"inputs {shapes}, ...")


def print_cache_stats() -> None:
    """Prints the cache directory, its number of graphs, its size and the compile time it saves."""
    cache = CompileCache()
    entries = list(cache.entries())
    print(f"compile cache: {cache.root}")
    print(f"graphs: {len(entries)}")
    print(f"size: {sum(entry.size for entry in entries) / 2**20:.2f} MiB")
    print(f"compile time stored: {sum(entry.metadata.get('compile_seconds', 0) for entry in entries):.1f} s")
    if backend_info().name == "torchneuron":
        print(f"TorchNeuron compiles through its own NEFF cache: {neff_cache_dir()}")


def clear_cache() -> None:
    """Removes every compiled graph."""
    cache = CompileCache()
    print(f"removed {cache.clear()} compiled graphs from {cache.root}")
