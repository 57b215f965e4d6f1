"""`optimum-cli neuron-torch cache list|stats|clear|push|pull`: the cache of compiled graphs."""

from __future__ import annotations

import sys

from ..compiler import remote
from ..compiler.cache import CompileCache
from ..device import backend_info


def list_cache() -> None:
    """Prints every compiled graph (key, size, compile time, first input shapes) and every compiled
    function saved for warm starts (key, size, function)."""
    cache = CompileCache()
    entries = list(cache.entries())
    functions = [entry for entry in entries if entry.is_function]
    print(f"{len(entries) - len(functions)} compiled graphs and {len(functions)} compiled functions in {cache.root}")
    for entry in entries:
        if entry.is_function:
            print(f"{entry.key[:16]}  {entry.size / 2**20:7.2f} MiB  function {entry.metadata.get('function')}")
            continue
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
    functions = sum(entry.is_function for entry in entries)
    print(f"graphs: {len(entries) - functions}")
    print(f"compiled functions (warm starts without tracing): {functions}")
    print(f"size: {sum(entry.size for entry in entries) / 2**20:.2f} MiB")
    print(f"compile time stored: {sum(entry.metadata.get('compile_seconds', 0) for entry in entries):.1f} s")
    neff_cache = backend_info().neff_cache
    if neff_cache is not None:
        print(f"TorchNeuron compiles through its own NEFF cache: {neff_cache}")


def clear_cache() -> None:
    """Removes every compiled graph and compiled function."""
    cache = CompileCache()
    print(f"removed {cache.clear()} compiled graphs and functions from {cache.root}")


def push_cache(destination: str) -> None:
    """Copies the compiled graphs to `destination` (a folder, an fsspec URL or `hf://org/repo`)."""
    report = remote.push(destination)
    print(report.summary("pushed", destination))


def pull_cache(source: str) -> None:
    """Copies the compiled graphs at `source` that this environment can use into the compile cache;
    the entries skipped are listed on stderr, each with why."""
    report = remote.pull(source)
    for reason in report.skipped:
        print(f"skipped {reason}", file=sys.stderr)
    print(report.summary("pulled", source))
