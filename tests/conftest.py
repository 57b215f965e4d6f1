"""Shared test setup: the `neuron` device is activated once for the session."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import settings

import optimum_neuron_torch  # noqa: F401  (activates the neuron device)
from optimum_neuron_torch.device import reference

# Property-based tests draw the same examples in every run, CI's included (`ci`, the default); a longer,
# random search: HYPOTHESIS_PROFILE=long python -m pytest tests/test_checkpoint_errors.py -k mutated
settings.register_profile("ci", max_examples=60, derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("long", max_examples=2000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def fallback_mode():
    """Sets the fallback mode for one test and restores it afterwards."""
    previous = reference.fallback_mode()
    yield reference.set_fallback_mode
    reference.set_fallback_mode(previous)


@pytest.fixture
def profile():
    """Switches the support profile for one test and restores it afterwards."""
    previous = reference.state().profile
    yield reference.set_profile
    reference.set_profile(previous)


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (same cache dir, so no rebuild) and returns the result."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=timeout
    )


def optimum_cli(*args: str, env: dict[str, str] | None = None, input: str | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `optimum-cli neuron-torch ARGS` from this interpreter's environment, `input` on its stdin."""
    command = [os.path.join(os.path.dirname(sys.executable), "optimum-cli"), "neuron-torch", *args]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})}, input=input,
                          timeout=timeout)


def assert_same(device_value: torch.Tensor, cpu_value: torch.Tensor, **tolerances) -> None:
    assert device_value.device.type == "neuron"
    torch.testing.assert_close(device_value.cpu(), cpu_value, **tolerances)
