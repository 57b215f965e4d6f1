"""Shared test setup: the `neuron` device is activated once for the session; the fixtures. (The
helper functions are in testing_utils.py.)"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

import optimum_neuron_torch  # noqa: F401  (activates the neuron device)
from optimum_neuron_torch.device import reference
from optimum_neuron_torch.settings import parse_flag
from testing_utils import clear_counts

# Property-based tests draw the same examples in every run, CI's included (`ci`, the default); a longer,
# random search: HYPOTHESIS_PROFILE=long python -m pytest tests/test_checkpoint_errors.py -k mutated
settings.register_profile("ci", max_examples=60, derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("long", max_examples=2000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# `python -m pytest` runs one pytest-xdist worker per core (pyproject's addopts). Torch's intra-op
# threads, one per core in every worker and in every subprocess a test starts, would then contend for
# the same cores: one thread each (a value the caller set is kept).
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the subprocesses
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # this worker

# The files that take longest (on 2 cores, with a fresh cache) run first, longest first. pytest-xdist
# gives each worker whole files (`--dist loadfile` in pyproject's addopts: a file's module-scoped
# fixtures, such as a compiled model, are then built once); a long file handed out last would keep one
# worker busy alone at the end. The other files follow in their usual order; tests within a file keep
# theirs.
SLOW_FILES_FIRST = [
    "test_tensor_parallel.py", "test_coverage.py", "test_opinfo.py", "test_examples.py", "test_torchneuron.py",
    "test_default_model.py", "test_notebooks.py", "test_training.py", "test_generation.py", "test_compile_cache.py",
    "test_cache_remote.py", "test_checkpoint_errors.py", "test_check.py", "test_commands.py", "test_serving.py",
    "test_pipelines.py", "test_patches.py",
]


# Tests in tiers, as Transformers' (its `@slow`, run when RUN_SLOW=1): `python -m pytest` runs the fast
# tier, which calls every public function at least once (tests/test_layout.py checks it);
# `RUN_SLOW=1 python -m pytest -m slow` runs the slow tier alone, `RUN_SLOW=1 python -m pytest` both.
# A test is slow when it mostly repeats, at a larger size or over more cases, what a fast test covers.
RUN_SLOW = parse_flag("RUN_SLOW")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a slow test, run only when RUN_SLOW=1 (the slow tier)")


def pytest_collection_modifyitems(config, items):
    if not RUN_SLOW:
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    rank = {name: index for index, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_report_header(config):
    return "slow tier: " + ("run (RUN_SLOW=1)" if RUN_SLOW else "not run (RUN_SLOW=1 runs it)")


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


@pytest.fixture
def fresh_dynamo():
    """Dynamo without the graphs of earlier tests, and the counts of `testing_utils.graphs()` at zero."""
    torch._dynamo.reset()
    clear_counts()
