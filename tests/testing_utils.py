"""Helpers shared by the tests (plain functions; the fixtures are in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch


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
