"""Helpers shared by the tests (plain functions; the fixtures are in conftest.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

from optimum_neuron_torch.compiler import cache_stats, reset_cache_stats


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (same cache dir, so no rebuild) and returns the result."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def optimum_cli(*args: str, env: dict[str, str] | None = None, input: str | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `optimum-cli neuron-torch ARGS` from this interpreter's environment, `input` on its stdin."""
    command = [os.path.join(os.path.dirname(sys.executable), "optimum-cli"), "neuron-torch", *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, env={**os.environ, **(env or {})},
                          input=input, timeout=timeout)


def assert_same(device_value: torch.Tensor, cpu_value: torch.Tensor, **tolerances) -> None:
    """`device_value` is on the neuron device and equals `cpu_value` (torch.testing.assert_close)."""
    assert device_value.device.type == "neuron"
    torch.testing.assert_close(device_value.cpu(), cpu_value, **tolerances)


# Jobs of several processes (tests/test_distributed.py, tests/test_tensor_parallel.py). Each rank of a test
# program writes `OUT/rank<r>.json`: the checks it made, each {"program", "name", "ok", "error", ...}.
def graphs() -> int:
    """The compiled functions this process got: traced by Dynamo, or restored from the compile cache
    without tracing (a warm start, see `compiler.precompiled`)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] + cache_stats().restored


def clear_counts() -> None:
    """Sets the counts `graphs()` and `recompiles()` read back to zero."""
    torch._dynamo.utils.counters.clear()
    reset_cache_stats()


def recompiles() -> int:
    return sum(torch._dynamo.utils.counters["recompiles"].values())


def assert_same_output(device_output: Any, cpu_output: Any) -> None:
    """Equal structure, strings and labels; numbers equal within a float32 tolerance."""
    if isinstance(cpu_output, dict):
        assert device_output.keys() == cpu_output.keys()
        for key in cpu_output:
            assert_same_output(device_output[key], cpu_output[key])
    elif isinstance(cpu_output, list):
        assert len(device_output) == len(cpu_output)
        for device_item, cpu_item in zip(device_output, cpu_output, strict=True):
            assert_same_output(device_item, cpu_item)
    elif isinstance(cpu_output, float):
        assert device_output == pytest.approx(cpu_output, rel=1e-4, abs=1e-6)
    elif isinstance(cpu_output, numpy.ndarray):  # (a waveform)
        numpy.testing.assert_allclose(device_output, cpu_output, rtol=1e-4, atol=1e-5)
    else:
        assert device_output == cpu_output


def wait_loaded(engine, timeout: float = 900) -> None:
    """Waits until a started generation engine serves with every graph loaded: graphs its compile
    cache held load in its idle turns, each holding device memory from then on (what a test of the
    memory or of the steps taken must not see change under it)."""
    engine.wait_ready(timeout=timeout)
    deadline = time.monotonic() + 300
    while engine.graphs_unloaded and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.graphs_unloaded


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    # (a rank that crashes or aborts prints the Python stack of each of its threads)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(extra or {})}
    env.pop("OPTIMUM_NEURON_TORCH_DEVICE_COUNT", None)  # one device per rank, from the launcher
    return env


def launch(world: int, *arguments: str, env: dict[str, str] | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs `python ARGUMENTS` as `world` ranks under torch's launcher (`torchrun`); asserts they all succeeded."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               f"--master-port={free_port()}", *arguments]
    result = subprocess.run(command, capture_output=True, text=True, env=launcher_environment(env), timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return result


def start_ranks(world: int, *arguments: str, out: Path, env: dict[str, str] | None = None,
                timeout: float = 120) -> tuple[list[int], list[list[dict]], list[str]]:
    """Starts `python ARGUMENTS` once per rank with the launcher's variables, as torchrun would, but lets a
    rank fail without the others being stopped: returns exit codes, checks and stderr of each rank."""
    port = free_port()
    processes = []
    for rank in range(world):
        env_rank = launcher_environment({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                                         "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                         "MASTER_PORT": str(port), **(env or {})})
        processes.append(subprocess.Popen([sys.executable, *arguments], env=env_rank, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
    codes, errors = [], []
    for process in processes:
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
        codes.append(process.returncode)
        errors.append(stderr)
    return codes, rank_checks(out, world), errors


def rank_checks(out: Path, world: int) -> list[list[dict]]:
    return [json.loads((out / f"rank{rank}.json").read_text()) if (out / f"rank{rank}.json").exists() else []
            for rank in range(world)]


def failures(checks: list[list[dict]], program: str | None = None) -> list[str]:
    return [f"rank {rank}: {check['name']}: {check.get('error')}" for rank, made in enumerate(checks)
            for check in made if not check["ok"] and (program is None or check["program"] == program)]


def names(checks: list[list[dict]], program: str) -> set[str]:
    return {check["name"] for made in checks for check in made if check["program"] == program}


def load_benchmark(file_name: str) -> Any:
    """A script of `benchmarks/` as a module (they are scripts, not a package), registered in
    `sys.modules` as `benchmark_<name>` (not its own name: `coverage` is a package too)."""
    import importlib.util

    name = f"benchmark_{Path(file_name).stem}"
    path = Path(__file__).resolve().parent.parent / "benchmarks" / file_name
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
