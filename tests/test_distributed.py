"""torch.distributed on the `neuron` device: the reference device's `neuron` process group.

The programs run in tests/distributed_programs.py, on 2 and 4 real processes: under `torchrun`, or
started one process per rank here (so that a rank can fail while the others report). Every check
there compares the device's result with the same computation done by one process on the CPU.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from optimum_neuron_torch.device.reference import collective_work
from optimum_neuron_torch.device.reference.distributed import BACKEND_NAME
from optimum_neuron_torch.errors import CollectiveArgumentError
from testing_utils import failures, launch, names, rank_checks, start_ranks

PROGRAMS = Path(__file__).with_name("distributed_programs.py")


def torchrun(out: Path, world: int, *programs: str, timeout: float = 600) -> list[list[dict]]:
    """Runs the programs under `torchrun --nproc-per-node world`; returns each rank's checks."""
    launch(world, str(PROGRAMS), str(out), *programs, timeout=timeout)
    return rank_checks(out, world)


def one_process_per_rank(out: Path, world: int, *programs: str, env: dict[str, str] | None = None,
                         timeout: float = 120) -> tuple[list[int], list[list[dict]], list[str]]:
    return start_ranks(world, str(PROGRAMS), str(out), *programs, out=out, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[list[dict]]:
    out = tmp_path_factory.mktemp("two_ranks")
    return torchrun(out, 2, "device", "collectives", "argument_errors", "dtensor", "ddp", "fsdp", "compiled")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[list[dict]]:
    out = tmp_path_factory.mktemp("four_ranks")
    return torchrun(out, 4, "device", "collectives", "dtensor")


# ---- in this process ----------------------------------------------------------------------------

def test_backend_registered_as_torchneuron_registers_it():
    assert BACKEND_NAME in dist.Backend.backend_list
    assert dist.Backend.default_device_backend_map["neuron"] == "neuron"
    assert dist.Backend.backend_capability["neuron"] == ["neuron"]


def test_a_group_of_one_in_process(tmp_path):
    dist.init_process_group("neuron", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert dist.get_backend() == "neuron"
        tensor = torch.arange(4.0, device="neuron")
        dist.all_reduce(tensor)
        assert tensor.cpu().tolist() == [0.0, 1.0, 2.0, 3.0] and tensor.device.type == "neuron"
        output = torch.zeros(4, device="neuron")
        dist.all_gather_into_tensor(output, tensor)
        assert output.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(CollectiveArgumentError, match=r"tensors\[0\] is on cpu"):
            dist.all_reduce(torch.ones(2))
        assert repr(dist.group.WORLD).startswith("ProcessGroupNeuron(rank=0, size=1")
        for coalesced in (dist.group.WORLD.allgather_into_tensor_coalesced,
                          dist.group.WORLD.reduce_scatter_tensor_coalesced):
            work = coalesced([], [])  # nothing to exchange: a work already done
            assert work.wait() and work.is_completed() and work.result() == []
    finally:
        dist.destroy_process_group()


def test_a_finished_collective_leaves_gloo_no_reference_to_its_tensors(tmp_path):
    """Once `wait()` returns, this thread holds the only references to the host views gloo worked on:
    gloo's worker freeing the last one would need the GIL, and at the interpreter's exit that aborts."""
    dist.init_process_group("neuron", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        group, tensor = dist.group.WORLD, torch.arange(4.0, device="neuron")
        works = [group.allreduce([tensor]), group.allgather([[torch.zeros(4, device="neuron")]], [tensor]),
                 group.alltoall([torch.zeros(4, device="neuron")], [tensor])]
        for work in works:
            views = list(collective_work._flatten(work._keep_alive))
            assert views and any(view._use_count() > 1 for view in views)  # gloo's work holds them
            work.wait()
            assert [view._use_count() for view in views] == [1] * len(views)
            assert work.is_completed() and work.is_success() and work.exception() is None and work.wait()
        assert not collective_work._ORPHANED_VIEWS
    finally:
        dist.destroy_process_group()


# ---- two and four processes ---------------------------------------------------------------------

@pytest.mark.parametrize("program", ["device", "collectives", "argument_errors", "dtensor", "ddp", "fsdp", "compiled"])
def test_two_ranks(two_ranks, program):
    assert len(names(two_ranks, program)) >= 1, f"{program} made no check"
    assert not failures(two_ranks, program), "\n".join(failures(two_ranks, program))


@pytest.mark.slow
@pytest.mark.parametrize("program", ["device", "collectives", "dtensor"])
def test_four_ranks(four_ranks, program):
    assert not failures(four_ranks, program), "\n".join(failures(four_ranks, program))


@pytest.mark.slow
def test_every_collective_checked(two_ranks, four_ranks):
    expected = {"all_reduce SUM", "all_reduce AVG", "all_reduce PREMUL_SUM", "all_reduce_coalesced",
                "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "broadcast", "reduce",
                "reduce_scatter", "reduce_scatter_tensor", "barrier", "all_to_all uneven",
                "all_to_all_single uneven", "gather", "scatter", "send/recv", "funcol all_reduce",
                "funcol all_gather_into_tensor_coalesced", "funcol reduce_scatter_tensor_coalesced"}
    for checks in (two_ranks, four_ranks):
        made = names(checks, "collectives")
        missing = {name for name in expected if not any(made_name.startswith(name) for made_name in made)}
        assert not missing


@pytest.mark.slow
def test_two_dimensional_mesh_ran(four_ranks):
    assert "2-D mesh full_tensor" in names(four_ranks, "dtensor")


# ---- failures -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("program", ["raise", "kill"])
def test_a_failed_rank_is_named_by_the_others(tmp_path, program):
    start = time.monotonic()
    # (a timeout far beyond the time a loaded machine takes to notice the exit: the test tells the two apart)
    codes, checks, errors = one_process_per_rank(tmp_path, 2, program, env={"NEURON_TEST_PG_TIMEOUT": "900"},
                                                 timeout=1200)
    assert codes[1] != 0
    assert time.monotonic() - start < 450, "rank 0 waited for the timeout instead of noticing the exit"
    (report,) = [check for check in checks[0] if check["name"] == "collective failed"]
    assert report["ok"], report
    assert "rank(s) 1 of this group exited" in report["error"] and report["failed_ranks"] == [1]
    assert "all_reduce failed on rank 0 of 2" in report["error"]


@pytest.mark.slow
def test_a_stuck_rank_fails_the_others_at_the_timeout(tmp_path):
    codes, checks, _ = one_process_per_rank(tmp_path, 2, "stall", env={"NEURON_TEST_PG_TIMEOUT": "3"}, timeout=90)
    (report,) = [check for check in checks[0] if check["name"] == "collective failed"]
    assert report["ok"], report
    assert report["seconds"] < 30 and report["failed_ranks"] == []
    assert "no peer process has exited" in report["error"] and "0:00:03" in report["error"]


def test_local_rank_beyond_the_device_count_is_refused(tmp_path):
    from testing_utils import run_python

    result = run_python("import optimum_neuron_torch", env={"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"})
    assert result.returncode != 0 and "LOCAL_RANK='3' names no device" in result.stderr

