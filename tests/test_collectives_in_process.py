"""The `neuron` process group (device/reference/distributed.py) and the tensor-parallel loading helpers
(loading/sharding.py) in this one process, for mutation testing: mutmut sees only in-process tests (the torchrun
ones of test_distributed.py and test_tensor_parallel.py import the package unmutated), and reruns each test that
reaches a mutant, so every test here takes well under a second. Ranks live in one process: a `ProcessGroupNeuron`
per rank over a shared HashStore, each rank's calls on a thread of its own. Inputs differ per rank, not
symmetrically, so a swapped index, root, op or split changes a result, compared with the CPU's; messages whole.
"""

import io
import os
import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import PretrainedConfig
from transformers.distributed import DistributedConfig

from optimum_neuron_torch import errors
from optimum_neuron_torch.device.reference import collective_work, distributed
from optimum_neuron_torch.device.reference.distributed import ProcessGroupNeuron, _has_exited, _process_identity
from optimum_neuron_torch.loading import sharding
from optimum_neuron_torch.loading.loader import _Plan, stream_into
from optimum_neuron_torch.loading.safetensors_file import SafetensorsFile

TIMEOUT = timedelta(seconds=5)  # gloo's: a collective a mutant breaks fails in seconds, not at torch's 30 minutes
HOST = socket.gethostname()
PREMUL, SUM, MAX = dist._make_nccl_premul_sum, dist.ReduceOp.SUM, dist.ReduceOp.MAX  # (gloo lacks PREMUL_SUM)


def each_rank(groups: list, fn) -> list:  # fn(rank, group) on a thread per rank (gloo's timeout ends a hang)
    with ThreadPoolExecutor(len(groups)) as pool:
        return list(pool.map(fn, range(len(groups)), groups))


@pytest.fixture
def world():  # world(size): `size` ranks in this process, a ProcessGroupNeuron each, built together
    made = []

    def make(size: int, timeout: timedelta = TIMEOUT) -> list[ProcessGroupNeuron]:
        store = dist.HashStore()
        store.set_timeout(timeout)  # (a rank that never writes its key fails the others in seconds too)
        made.extend(groups := each_rank([None] * size, lambda rank, _: ProcessGroupNeuron(store, rank, size, timeout)))
        return groups
    yield make
    for group in made:
        group.shutdown()


def data(rank: int, *shape: int, salt: int = 0) -> torch.Tensor:  # exact floats, a slope and offset per rank
    return (torch.arange(torch.Size(shape).numel()) * (rank + 1) + 10 * rank + 100 * salt).reshape(shape).float()


def on(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("neuron")


def zeros(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device="neuron")


def done(work, op: str) -> list:  # waits; checks the op's name (which a failure names); the tensors it wrote
    held = list(collective_work._flatten(work._keep_alive))  # the host views gloo works on
    assert work._op == op and (bool(held) or op == "barrier") and work.wait()
    assert [view._use_count() for view in held] == [1] * len(held)  # gloo has let go of every one
    return work.result()


def same(actual, expected) -> None:  # `neuron` tensors (or lists of them) equal to the CPU's
    for got, want in zip(*((actual, expected) if isinstance(actual, list) else ([actual], [expected])), strict=True):
        assert got.device.type == "neuron" and torch.equal(got.cpu(), want), (got.cpu(), want)


def options(kind, **values):  # (one per call and rank: a PREMUL_SUM op rewrites its options to a SUM)
    opts = kind()
    for name, value in values.items():
        setattr(opts, name, value)
    return opts


def refused(error_type: type, call, message: str) -> BaseException:
    with pytest.raises(error_type) as caught:
        call()
    assert str(caught.value) == message
    return caught.value


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_collective_against_the_cpu(world, size):
    stack, ranks = torch.stack([data(r, 2, 3) for r in range(size)]), range(size)
    total, other = stack.sum(0), sum(data(r, 4, salt=1) for r in ranks)
    ops = [(SUM, total), (dist.ReduceOp.PRODUCT, stack.prod(0)), (dist.ReduceOp.MIN, stack.amin(0)),
           (MAX, stack.amax(0)), (dist.ReduceOp.AVG, total / size)]

    def run(rank, group):
        for op, expected in [*ops, (PREMUL(0.5), total * 0.5)]:
            tensor = on(data(rank, 2, 3))  # passed bare (a list, torch.distributed's form, in the error test)
            assert done(group.allreduce(tensor, options(dist.AllreduceOptions, reduceOp=op)), "all_reduce") == [tensor]
            same(tensor, expected)
        for opts, factor in ((None, 1), (options(dist.AllreduceCoalescedOptions, reduceOp=PREMUL(2.0)), 2)):
            tensors = [on(data(rank, 2, 3)), on(data(rank, 4, salt=1))]
            assert done(group.allreduce_coalesced(tensors, opts), "all_reduce_coalesced") == tensors
            same(tensors, [factor * total, factor * other])
        for root in (0, size - 1):
            tensors = [on(data(rank, 2, 3)), on(data(rank, 4, salt=1))]
            assert done(group.reduce(tensors[:1], options(dist.ReduceOptions, rootRank=root)), "reduce") == tensors[:1]
            group.reduce(tensors[1:], options(dist.ReduceOptions, rootRank=root, reduceOp=PREMUL(3.0))).wait()
            if rank == root:
                same(tensors, [total, 3.0 * other])
        tensors = [on(data(rank, 2, 3))]
        assert done(group.broadcast(tensors, options(dist.BroadcastOptions, rootRank=1)), "broadcast") == tensors
        same(tensors, [data(1, 2, 3)])
        pieces = torch.stack([data(r, 2, 3, salt=rank) for r in ranks])  # what the ranks reduce into this one
        for op, expected in ((None, pieces.sum(0)), (MAX, pieces.amax(0)), (PREMUL(3.0), 3 * pieces.sum(0))):
            outputs, opts = [zeros(2, 3), zeros(2, 3)], [op and options(dist.ReduceScatterOptions, reduceOp=op)
                                                         for _ in range(2)]
            work = group.reduce_scatter(outputs[:1], [[on(data(rank, 2, 3, salt=d)) for d in ranks]], opts[0])
            assert done(work, "reduce_scatter") == outputs[:1]
            work = group._reduce_scatter_base(outputs[1], on(torch.cat([data(rank, 2, 3, salt=d) for d in ranks])),
                                              opts[1])
            assert done(work, "reduce_scatter_tensor") == outputs[1:]
            same(outputs, [expected, expected])
        # two ops given one PREMUL_SUM options object (which an op rewrites): each must get the factor
        outputs = [zeros(2, 3), zeros(4)]
        inputs = [on(torch.cat([data(rank, 2, 3, salt=d) for d in ranks])),
                  on(torch.cat([data(rank, 4, salt=10 + d) for d in ranks]))]
        opts = options(dist.ReduceScatterOptions, reduceOp=PREMUL(3.0))
        assert done(group.reduce_scatter_tensor_coalesced(outputs, inputs, opts), "reduce_scatter_tensor") == outputs
        same(outputs, [3 * pieces.sum(0), 3 * sum(data(r, 4, salt=10 + rank) for r in ranks)])

        outputs = [zeros(2, 3) for _ in ranks]
        assert done(group.allgather([outputs], [on(data(rank, 2, 3))]), "all_gather") == outputs
        same(outputs, [data(r, 2, 3) for r in ranks])
        flat, stacked = zeros(size * 4), zeros(size, 2, 3)  # (the stacked form: gloo sees a flat buffer)
        assert done(group._allgather_base(flat, on(data(rank, 4))), "all_gather_into_tensor") == [flat]
        group._allgather_base(stacked, on(data(rank, 2, 3))).wait()
        same([flat, stacked], [torch.cat([data(r, 4) for r in ranks]), torch.stack([data(r, 2, 3) for r in ranks])])
        lists = [[zeros(2, 3), zeros(4)] for _ in ranks]
        work = group.allgather_coalesced(lists, [on(data(rank, 2, 3)), on(data(rank, 4, salt=1))])
        assert done(work, "all_gather_coalesced") == sum(lists, [])
        same(sum(lists, []), [tensor for r in ranks for tensor in (data(r, 2, 3), data(r, 4, salt=1))])
        outputs = [zeros(size * 2, 3), zeros(size * 4)]
        work = group.allgather_into_tensor_coalesced(outputs, [on(data(rank, 2, 3)), on(data(rank, 4, salt=1))],
                                                     dist.distributed_c10d.AllgatherOptions())
        assert done(work, "all_gather_into_tensor") == outputs  # every output, not only the last op's
        same(outputs, [torch.cat([data(r, 2, 3) for r in ranks]), torch.cat([data(r, 4, salt=1) for r in ranks])])
        received = [data(s, s + 2 * rank + 1, 2, salt=rank) for s in ranks]  # r sends r + 2d + 1 rows to d
        output = zeros(sum(s + 2 * rank + 1 for s in ranks), 2)
        work = group.alltoall_base(output, on(torch.cat([data(rank, rank + 2 * d + 1, 2, salt=d) for d in ranks])),
                                   [s + 2 * rank + 1 for s in ranks], [rank + 2 * d + 1 for d in ranks])
        assert done(work, "all_to_all_single") == [output]
        same(output, torch.cat(received))
        outputs = [zeros(s + 2 * rank + 1, 2) for s in ranks]
        pointers = [tensor.data_ptr() for tensor in outputs]
        work = group.alltoall(outputs, [on(data(rank, rank + 2 * d + 1, 2, salt=d)) for d in ranks])
        assert done(work, "all_to_all") == outputs and [tensor.data_ptr() for tensor in outputs] == pointers  # copied
        same(outputs, received)
        outputs = [zeros(2, dtype=torch.int64) for _ in ranks]
        done(group.alltoall(outputs, [on(data(rank, 2, salt=d).long() * 2**40) for d in ranks]), "all_to_all")
        same(outputs, [data(s, 2, salt=rank).long() * 2**40 for s in ranks])  # (exact only as 64-bit integers)
        lists = [[zeros(2, 3) for _ in ranks]] if rank == size - 1 else []  # gathered at the last rank
        work = group.gather(lists, [on(data(rank, 2, 3))], options(dist.GatherOptions, rootRank=size - 1))
        assert done(work, "gather") == sum(lists, [])
        same(sum(lists, []), [data(r, 2, 3) for r in ranks] if lists else [])
        output = zeros(4)
        inputs = [[on(data(d, 4, salt=9)) for d in ranks]] if rank == 1 else []  # scattered from rank 1
        assert done(group.scatter([output], inputs, options(dist.ScatterOptions, rootRank=1)), "scatter") == [output]
        same(output, data(rank, 4, salt=9))
        assert done(group.barrier(), "barrier") == []
        received, after, before = zeros(3), (rank + 1) % size, (rank - 1) % size
        sent = group.send([on(data(rank, 3))], after, 7)
        assert done(group.recv([received], before, 7), f"recv from rank {before}") == [received]
        assert done(sent, f"send to rank {after}")
        same(received, data(before, 3))
        sent = group.send([on(data(rank, 3, salt=2))], after)  # the default tag, 0, on one side or the other
        same(done(group.recv([zeros(3)], before, 0), f"recv from rank {before}"), [data(before, 3, salt=2)])
        done(sent, f"send to rank {after}")
        sent = group.send([on(data(rank, 3, salt=3))], after, 0)
        same(done(group.recv([zeros(3)], before), f"recv from rank {before}"), [data(before, 3, salt=3)])
        done(sent, f"send to rank {after}")
        if rank:  # rank 0 receives from every other rank, in any order
            return group.send([on(data(rank, 3, salt=1))], 0, 0).wait()
        firsts = [done(group.recv_anysource([zeros(3)]), "recv from any rank")[0][0].item() for _ in ranks[1:]]
        assert sorted(firsts) == [data(r, 3, salt=1)[0].item() for r in ranks[1:]]
    each_rank(world(size), run)


class RecordingGloo:  # gloo's group, noting the options object each op hands it
    def __init__(self, gloo) -> None:
        self.gloo, self.timeouts = gloo, {}

    def __getattr__(self, name: str):
        def call(*arguments):
            self.timeouts[name] = next((argument.timeout for argument in arguments if hasattr(argument, "timeout")),
                                       None)
            return getattr(self.gloo, name)(*arguments)
        return call


def test_the_callers_options_reach_gloo_and_a_barrier_waits_for_every_rank(world):
    ranks, seconds = range(2), timedelta(seconds=42)  # (a timeout of the op's own, which gloo must get)
    entered = [threading.Event() for _ in ranks]

    def run(rank, group):
        group._gloo = recording = RecordingGloo(group._gloo)
        kind, to_all = (options(dist.distributed_c10d.AllgatherOptions, timeout=seconds),
                        options(dist.distributed_c10d.AllToAllOptions, timeout=seconds))
        group.allreduce_coalesced([zeros(2)], options(dist.AllreduceCoalescedOptions, timeout=seconds)).wait()
        group.allgather([[zeros(2) for _ in ranks]], [zeros(2)], kind).wait()
        group._allgather_base(zeros(4), zeros(2), kind).wait()
        group.allgather_coalesced([[zeros(2)] for _ in ranks], [zeros(2)], kind).wait()
        group.allgather_into_tensor_coalesced([zeros(4)], [zeros(2)], kind).wait()
        group.alltoall_base(zeros(2), zeros(2), [], [], to_all).wait()
        timeouts = dict(recording.timeouts)
        group.alltoall([zeros(1) for _ in ranks], [zeros(1) for _ in ranks], to_all).wait()
        if rank:
            time.sleep(0.3)  # (rank 0 is in the barrier by now: it must wait for this rank)
        entered[rank].set()
        group.barrier().wait()
        return timeouts, recording.timeouts["alltoall_base"], all(event.is_set() for event in entered)

    for timeouts, alltoall, everyone_entered in each_rank(world(2), run):
        assert timeouts == dict.fromkeys(["allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
                                          "alltoall_base"], seconds)
        assert alltoall == seconds and everyone_entered


def test_the_group_and_its_argument_errors_which_name_the_op_the_tensor_and_the_fault(world):
    groups = world(3)
    assert repr(groups[2]) == "ProcessGroupNeuron(rank=2, size=3, reference device over gloo)"
    assert groups[0].getBackendName() == "neuron" and groups[0].group_name == ""
    groups[0]._set_group_name("tp")
    assert (groups[0].group_name, groups[1].group_name) == ("tp", "")
    neuron = torch.device("neuron")
    assert groups[1]._get_backend(neuron) is groups[1] and groups[1]._device_types == [neuron]
    groups[0].abort()  # (gloo's own: reached; nothing more to see in one process)
    assert groups[2]._peers == [_process_identity()] * 3 and groups[2]._timeout == TIMEOUT
    opts = options(dist.ReduceScatterOptions, reduceOp=MAX, timeout=timedelta(seconds=7), asyncOp=False)
    copy = distributed._copy_options(opts)  # (one per op of a coalesced call)
    assert copy is not opts and (copy.reduceOp, copy.timeout, copy.asyncOp) == (MAX, timedelta(seconds=7), False)
    on_cpu = ("{} is on cpu, but the `neuron` process group takes neuron tensors only (rank 1 uses neuron:0). Move "
              "it with `.to('neuron')`, or create a gloo group for CPU tensors: dist.new_group(backend='gloo').")
    two = ("the tensors of rank 1 are on several devices (neuron:0 and neuron:1, {}); one process drives one neuron "
           "device.")
    count = "{} has 2 entries on rank 1, expected one per rank (3)."
    shape = "{} has shape (5,) on rank 1, expected (4,)."
    numel = "{}: {} has 5 elements (shape (5,)) on rank 1, expected 12 (the {}'s 4 times 3 ranks)."
    contiguous = "{}: the {} (shape {}, strides {}) is not contiguous on rank 1; pass `.contiguous()` (and copy " \
                 "the result back) instead."
    coalesced = "{}: {} outputs for {} inputs on rank 1."

    class OtherCore(torch.Tensor):  # says it is on neuron:1 (this process has one device): the two-devices check
        device = property(lambda self: torch.device("neuron", 1))
    g, z, o = groups[1], zeros, (lambda n: torch.Tensor._make_subclass(OtherCore, zeros(n)))
    gather, scatter = options(dist.GatherOptions, rootRank=1), options(dist.ScatterOptions, rootRank=1)
    split = "all_to_all_single: input_split_sizes [1, 1, 1] sum to 3 on rank 1, but the input has"

    def each(template, *cases):  # cases: op, argument, call(a tensor on the CPU or on neuron:1, by the template)
        bad = (lambda: torch.zeros(4)) if template is on_cpu else (lambda: o(4))
        return [(lambda call=call: call(bad()), f"{op}: " + template.format(name)) for op, name, call in cases]

    for call, message in [
        *each(on_cpu, ("all_reduce", "tensors[1]", lambda t: g.allreduce([z(4), t])),
              ("all_reduce_coalesced", "tensors[0]", lambda t: g.allreduce_coalesced([t])),
              ("reduce", "tensors[0]", lambda t: g.reduce([t])),
              ("broadcast", "tensors[0]", lambda t: g.broadcast([t])),
              ("all_gather", "input[0]", lambda t: g.allgather([[z(4)] * 3], [t])),
              ("all_gather_coalesced", "input[0]", lambda t: g.allgather_coalesced([[z(4)] * 3], [t])),
              ("all_gather_into_tensor", "tensors[1]", lambda t: g._allgather_base(z(12), t)),
              ("reduce_scatter", "output[0]", lambda t: g.reduce_scatter([t], [[z(4)] * 3])),
              ("all_to_all_single", "tensors[1]", lambda t: g.alltoall_base(z(3), t[:3], [], [])),
              ("all_to_all", "output[0]", lambda t: g.alltoall([t, z(4), z(4)], [z(4)] * 3)),
              ("gather", "input[0]", lambda t: g.gather([], [t])),
              ("scatter", "output[0]", lambda t: g.scatter([t], [])),
              ("send", "tensors[0]", lambda t: g.send([t], 0)), ("recv", "tensors[0]", lambda t: g.recv([t], 0)),
              ("recv", "tensors[0]", lambda t: g.recv_anysource([t]))),
        # the device of the op's other tensors is checked against the first's (neuron:0), whatever their order
        *each(two, ("all_reduce_coalesced", "tensors[1]", lambda t: g.allreduce_coalesced([z(4), t])),
              ("all_gather", "output[0]", lambda t: g.allgather([[t, z(4), z(4)]], [z(4)])),
              ("all_gather_coalesced", "output[0]", lambda t: g.allgather_coalesced([[t]], [z(4)])),
              ("reduce_scatter", "input[0]", lambda t: g.reduce_scatter([z(4)], [[t, z(4), z(4)]])),
              ("all_to_all", "input[0]", lambda t: g.alltoall([z(4)] * 3, [t, z(4), z(4)])),
              ("gather", "gather_list[0]", lambda t: g.gather([[t, z(4), z(4)]], [z(4)], gather)),
              ("scatter", "scatter_list[0]", lambda t: g.scatter([z(4)], [[t, z(4), z(4)]], scatter))),
        *[(lambda call=call: call(), f"{op}: " + count.format(name)) for op, name, call in (
            ("all_gather", "output list", lambda: g.allgather([[z(4)] * 2], [z(4)])),
            ("reduce_scatter", "input list", lambda: g.reduce_scatter([z(4)], [[z(4)] * 2])),
            ("all_to_all_single", "output_split_sizes", lambda: g.alltoall_base(z(3), z(3), [1, 2], [])),
            ("all_to_all", "output list", lambda: g.alltoall([z(1)] * 2, [z(1)] * 3)),
            ("all_to_all", "input list", lambda: g.alltoall([z(1)] * 3, [z(1)] * 2)),
            ("gather", "gather_list", lambda: g.gather([[z(4)] * 2], [z(4)], gather)),
            ("scatter", "scatter_list", lambda: g.scatter([z(4)], [[z(4)] * 2], scatter)))],
        *[(lambda call=call, opts=opts, root=root: call(options(opts, rootRank=root)),
           f"{op}: root rank {root} is outside this group of 3 ranks.") for op, call, opts, root in (
            ("reduce", lambda opts: g.reduce([z(2)], opts), dist.ReduceOptions, 3),
            ("broadcast", lambda opts: g.broadcast([z(2)], opts), dist.BroadcastOptions, -1),
            ("gather", lambda opts: g.gather([], [z(2)], opts), dist.GatherOptions, 3),
            ("scatter", lambda opts: g.scatter([z(2)], [], opts), dist.ScatterOptions, 3))],
        (lambda: g.send([z(2)], 3), "send: destination rank 3 is outside this group of 3 ranks."),
        (lambda: g.recv([z(2)], -1), "recv: source rank -1 is outside this group of 3 ranks."),
        (lambda: g.allreduce([z(2), 3]), "all_reduce: tensors[1] is of type int, not a tensor."),
        (lambda: g.allgather([[z(4), z(5), z(4)]], [z(4)]), "all_gather: " + shape.format("output[1]")),
        (lambda: g.reduce_scatter([z(4)], [[z(4), z(4), z(5)]]), "reduce_scatter: " + shape.format("input[2]")),
        (lambda: g._allgather_base(z(5), z(4)), numel.format("all_gather_into_tensor", "output", "input")),
        (lambda: g._reduce_scatter_base(z(4), z(5)), numel.format("reduce_scatter_tensor", "input", "output")),
        *[(call, contiguous.format(*what)) for call, *what in (
            (lambda: g._allgather_base(z(3, 4).t(), z(4)), "all_gather_into_tensor", "output", (4, 3), (1, 4)),
            (lambda: g._reduce_scatter_base(z(4), z(4, 3).t()), "reduce_scatter_tensor", "input", (3, 4), (1, 3)))],
        (lambda: g.allgather([[z(4)] * 3] * 2, [z(4)]), "all_gather: 2 output lists for 1 inputs on rank 1."),
        (lambda: g.reduce_scatter([z(4)], [[z(4)] * 3] * 2), "reduce_scatter: 1 outputs for 2 input lists on rank 1."),
        (lambda: g.allgather_into_tensor_coalesced([z(12)] * 2, [z(4)]),
         coalesced.format("all_gather_into_tensor_coalesced", 2, 1)),
        (lambda: g.reduce_scatter_tensor_coalesced([z(4)], [z(12)] * 2),
         coalesced.format("reduce_scatter_tensor_coalesced", 1, 2)),
        (lambda: g.alltoall_base(z(3), z(4, 2), [], [1, 1, 1]), f"{split} 4 rows (shape (4, 2))."),
        (lambda: g.alltoall_base(z(3), z(), [], [1, 1, 1]), f"{split} 1 rows (shape ())."),
        (lambda: g.alltoall_base(z(4), z(3), [], []), "all_to_all_single: the output's 4 rows (shape (4,)) do not "
                                                      "split evenly over 3 ranks on rank 1; pass output_split_sizes."),
        (lambda: g.alltoall([z(1)] * 3, [z(1), z(1), z(1, dtype=torch.int64)]),
         "all_to_all: tensors of several dtypes on rank 1: ['torch.float32', 'torch.int64']."),
        # refused by gloo as the op starts: quoted after the op and the rank (no tensors: no device to take)
        *[(call, f"{op} on rank 1: ProcessGroupGloo::{gloo}") for call, op, gloo in (
            (lambda: g.reduce([z(4), z(4)]), "reduce", "reduce: requires a single-element tensor list"),
            (lambda: g.allgather_coalesced([], []), "all_gather_coalesced",
             "allgather_coalesced: requires non-empty input tensor list"),
            (lambda: g.gather([], []), "gather", "gather: requires a single-element input tensor list"),
            (lambda: g.gather([[z(4)] * 3], [], gather), "gather", "gather: requires a single-element input tensor "
                                                                   "list"),
            (lambda: g.scatter([], []), "scatter", "scatter: requires a single-element output tensor list"),
            (lambda: g.scatter([], [[z(4)] * 3], scatter), "scatter", "scatter: requires a single-element output "
                                                                      "tensor list"))],
        (lambda: g._run("op", mock.Mock(side_effect=RuntimeError()), [], ()), "op on rank 1: RuntimeError"),
    ]:
        refused(errors.CollectiveArgumentError, call, message)


def test_exited_peers_are_seen_and_named_by_a_failure(world, tmp_path, monkeypatch):
    (process := subprocess.Popen(["true"])).wait()
    dead = f"{HOST}:{process.pid}"  # a process of this host that has exited
    assert _process_identity() == f"{HOST}:{os.getpid()}" and not _has_exited(_process_identity())
    assert _has_exited(dead) and not _has_exited(f"another-host:{dead.rpartition(':')[2]}")
    assert not _has_exited(dead.replace(":", ":extra:"))  # the pid follows the last colon
    # a zombie whose name holds ") R (": its state is the field after the last parenthesis
    (tmp_path / "s) R (").symlink_to(shutil.which("sleep"))
    zombie = subprocess.Popen([str(tmp_path / "s) R ("), "0"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    assert _has_exited(f"{HOST}:{zombie.pid}")
    zombie.wait()
    for state, exited in (("R", False), ("S", False), ("D", False), ("T", False), ("Z", True), ("X", True)):
        stat = f"{zombie.pid} (a (b) c) {state} 1 {zombie.pid}"
        monkeypatch.setattr(distributed, "open", lambda path, stat=stat: io.StringIO(stat), raising=False)
        assert _has_exited(f"{HOST}:{zombie.pid}") is exited, state
    monkeypatch.setattr(distributed, "open", mock.Mock(side_effect=PermissionError()), raising=False)  # no /proc
    monkeypatch.setattr(os, "kill", kill := mock.Mock(wraps=os.kill))
    assert _has_exited(dead) and kill.call_args == mock.call(process.pid, 0)  # the kernel is asked (signal 0: asks,
    assert not _has_exited(_process_identity())                               # sends nothing)
    monkeypatch.setattr(os, "kill", mock.Mock(side_effect=PermissionError()))
    assert not _has_exited(dead)  # (another user's process: alive)
    monkeypatch.undo()
    groups = world(4)  # a failure names the peers that exited, or the timeout
    groups[0]._peers = [dead, dead, _process_identity(), dead]  # its own entry is not a peer's
    start = time.monotonic()
    error = groups[0]._failure("all_reduce", RuntimeError("Connection closed by peer\nmore"))
    assert time.monotonic() - start < 1.5 and error.rank == 0 and error.failed_ranks == [1, 3]  # no wait: exited
    assert str(error) == ("neuron process group: all_reduce failed on rank 0 of 4: rank(s) 1, 3 of this group exited; "
                          "see the failed rank's own error (torchrun prints it as the root cause). gloo said: "
                          "Connection closed by peer")
    monkeypatch.setattr(distributed, "_EXIT_GRACE_SECONDS", 0.3)
    start = time.monotonic()
    error = groups[1]._failure("broadcast", RuntimeError(""))  # its peers are alive
    assert 0.3 <= time.monotonic() - start < 1.0  # polls for the grace period, not past it
    assert isinstance(error, errors.CollectiveError) and error.rank == 1 and error.failed_ranks == []
    assert str(error) == (
        "neuron process group: broadcast failed on rank 1 of 4: no peer process has exited (a peer may be stuck, "
        "raised and caught, or on another host); every rank must call the same collectives in the same order; the "
        "timeout is 0:00:05 (init_process_group(timeout=...)). gloo said: RuntimeError")
    work = groups[1]._run("gather", lambda: mock.Mock(**{"wait.side_effect": RuntimeError()}), [], ())
    refused(errors.CollectiveError, work.wait, str(error).replace("broadcast", "gather"))  # a failure at wait


def test_the_arguments_and_the_model_are_checked_before_loading(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert sharding.distributed_config(None, None, None) is None and sharding.distributed_config(None, None, 1) is None
    assert sharding.distributed_config(None, None, 2).tp_size == 2
    assert sharding.distributed_config(config := DistributedConfig(tp_size=2), None, None) is config
    assert sharding.distributed_config(None, "auto", None) is None  # tp_size from WORLD_SIZE (1 without a launcher)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (lambda c: (c.tp_size, c.tp_plan))(sharding.distributed_config(None, "auto", None)) == (2, "auto")
    both = "pass either distributed_config or tp_plan / tp_size, not both (set them on DistributedConfig)"
    for arguments, message in [(({"tp_size": 2}, "auto", None), both), (({"tp_size": 2}, None, 2), both)] + [
        ((asked, None, None), f"from_pretrained() shards models by tensor parallelism only (tp_size), but "
         f"{DistributedConfig.from_dict(asked)!r} asks for {named}; load with Transformers' own from_pretrained for "
         "FSDP, pipeline or expert parallelism.") for asked, named in (
            ({"fsdp_size": 2, "dp_replicate_size": 3}, "fsdp_size=2, dp_replicate_size=3"),
            ({"pp_size": 2}, "pp_size=2"), ({"fsdp_size": 2, "ep_size": 2}, "fsdp_size=2, ep_size=2"))]:
        refused(errors.ConfigurationError, lambda a=arguments: sharding.distributed_config(*a), message)
    sharding.check_divisible(PretrainedConfig(num_attention_heads=8, num_key_value_heads=4), 4, "m")
    for (heads, kv_heads, experts, local_experts), tp_size, described, degrees in (
            ((9, 3, None, None), 2, "9 attention heads and 3 key-value heads", "1, 3"),
            ((8, 0, 6, "x"), 4, "8 attention heads and 6 experts", "1, 2"),  # (no count of 0, nor one not a number)
            ((6, None, None, None), 4, "6 attention heads", "1, 2, 3, 6"),
            ((8, None, None, 3), 2, "8 attention heads and 3 experts", "1"),
            ((8, 1, None, None), 2, "8 attention heads and 1 key-value heads", "1")):  # (multi-query: one counts)
        config = PretrainedConfig(num_attention_heads=heads, num_key_value_heads=kv_heads, num_experts=experts,
                                  num_local_experts=local_experts)
        refused(errors.ConfigurationError, lambda c=config, n=tp_size: sharding.check_divisible(c, n, "tiny"),
                f"tiny has {described}: tp_size={tp_size} does not divide them, so a head would be split between "
                f"ranks. Use a tp_size that divides them: {degrees}.")


class _Model:  # what `shard` reads of a model: its plan, config and parameters (a real split needs several ranks)
    maybe_distribute_model = mock.Mock(side_effect=lambda model, config, mesh_manager: model)

    def __init__(self, tp_plan, parameters):
        self.tp_plan, self.named_parameters = tp_plan, parameters.items
        self.config = SimpleNamespace(model_type="fake")


@pytest.fixture
def mesh(tmp_path):  # a mesh over the default group, of one rank, made through the registered backend
    dist.init_process_group("neuron", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=77))
    yield init_device_mesh("neuron", (1,))
    dist.destroy_process_group()


def test_init_process_group_makes_the_group_and_the_pieces_and_shard(mesh):
    host_view, group = distributed._host_view, dist.group.WORLD
    distributed.register(lambda tensor: tensor)  # a second registration changes nothing
    assert distributed._host_view is host_view and isinstance(group, ProcessGroupNeuron)
    assert (group.rank(), group.size(), group._timeout) == (0, 1, timedelta(seconds=77))
    assert group._gloo.options._timeout == timedelta(seconds=77)  # (gloo's own: its waits end then)
    # the functional collective's C++ kernel (which asks the group for a C++ backend), replaced
    same(torch.ops._c10d_functional.all_gather_into_tensor_out(on(data(0, 3)), 1, group.group_name, out=zeros(3)),
         data(0, 3))
    assert sharding.local_bytes(plain := torch.zeros(3, 5, dtype=torch.bfloat16)) == 30
    assert sharding.local_shape(plain) == (3, 5)
    assert sharding.local_piece(plain) is None and sharding.as_parameter_value(plain, torch.ones(1)) is plain
    # this rank's piece, 4 x 3, of a 4 x 6 parameter split by columns (declared: a mesh of one rank holds it all)
    parameter = DTensor.from_local(zeros(4, 3), mesh, [Shard(1)], run_check=False, shape=torch.Size((4, 6)),
                                   stride=(6, 1))
    assert sharding.local_bytes(parameter) == 48 and sharding.local_shape(parameter) == (4, 3)
    assert torch.equal(sharding.local_piece(parameter)(full := torch.arange(24.0).reshape(4, 6)), full)  # (1 rank)
    value = sharding.as_parameter_value(piece := on(data(1, 4, 3)), parameter)
    assert isinstance(value, DTensor) and value.device_mesh is mesh and value.placements == (Shard(1),)
    assert value.shape == (4, 6) and value.stride() == (6, 1) and value.to_local().data_ptr() == piece.data_ptr()
    config = DistributedConfig(tp_size=2)
    refused(errors.UnsupportedModelError, lambda: sharding.shard(_Model({}, {}), config, "mesh", "m"),
            "m (fake) has no tensor-parallel plan in Transformers (its config has no base_model_tp_plan), so it "
            "cannot be split between ranks. Load it on one device (no tp_size), or give a plan: distributed_config="
            "DistributedConfig(tp_size=N, tp_plan={'layers.*.self_attn.q_proj': 'colwise', ...}).")
    parameters = {"plain": zeros(5), "replicated": DTensor.from_local(zeros(5), mesh, [Replicate()]),
                  "rows": DTensor.from_local(zeros(4, 5), mesh, [Shard(0)])}
    model = _Model({"q": "colwise"}, parameters)
    assert sharding.shard(model, config, "mesh", "m") is model
    assert _Model.maybe_distribute_model.call_args == mock.call(model, config, "mesh")
    assert sharding.shard(_Model({}, {}), DistributedConfig(tp_size=2, tp_plan={"q": "rowwise"}), "mesh", "m")
    parameters["layers.0.q.weight"] = DTensor.from_local(zeros(4, 5), mesh, [Shard(1)])
    refused(errors.ConfigurationError, lambda: sharding.shard(model, config, "mesh", "m"), "m: layers.0.q.weight has "
            "5 rows along the dimension the tensor-parallel plan splits, which tp_size=2 does not divide; use a "
            "tp_size that does.")


def fake_dist(monkeypatch, initialized=False, world=1, rank=0, init_error=None) -> mock.Mock:  # a job of ranks
    init = mock.Mock(side_effect=init_error)
    monkeypatch.setattr(sharding, "dist", SimpleNamespace(is_initialized=lambda: initialized, get_rank=lambda: rank,
                                                          get_world_size=lambda: world, init_process_group=init))
    return init


def test_start_checks_the_job_then_starts_the_group_and_agree_tells_every_rank(monkeypatch):
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "0"), ("NEURON_RT_VISIBLE_CORES", "0-1"),
                        ("OPTIMUM_NEURON_TORCH_DISTRIBUTED_TIMEOUT", "42")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sharding.PreTrainedModel, "prepare_distribute_model", lambda config: (1, 2, ("mm", config)))
    steps, agree = [], sharding.agree
    monkeypatch.setattr(sharding, "agree", lambda step, error: steps.append((step, error)) or agree(step, error))
    config, init = DistributedConfig(tp_size=2), fake_dist(monkeypatch)
    assert sharding.start(config) == ("mm", config) and torch.neuron.current_device() == 0
    assert steps == [("selecting its NeuronCore", None)]  # (the step a rank that fails it is named for)
    monkeypatch.setattr(sharding, "agree", agree)
    assert init.call_args_list == [mock.call("neuron", timeout=timedelta(seconds=42))]
    init = fake_dist(monkeypatch, initialized=True, world=2)
    assert sharding.start(config) == ("mm", config) and not init.called  # the script's group: not started again
    core = ("rank {} (local rank {}) cannot have a NeuronCore of its own: {}. It was launched with "
            "NEURON_RT_VISIBLE_CORES='0-1'. Launch one process per core with torchrun and leave "
            "NEURON_RT_VISIBLE_CORES unset (the process group gives each rank the core of its local rank), or set it "
            "to one core per rank, different on each rank.")
    refusal = AssertionError("can't have more than one device per process")  # (TorchNeuron's setup)
    jobs = "tp_size=2 asks for 2 ranks but this job has {0} process(es) (WORLD_SIZE); start it with `torchrun " \
           "--nproc-per-node 2 ...`, or pass tp_size={0}."
    for env, kwargs, message in (  # (the last: no core 3 here, named with the rank in the group, 2, not RANK)
            (("WORLD_SIZE", "3"), {"initialized": True}, jobs.format(1)),  # the group's size when it exists
            (("WORLD_SIZE", "3"), {}, jobs.format(3)),  # else WORLD_SIZE
            (("WORLD_SIZE", "2"), {"init_error": refusal}, core.format(1, 0, f"AssertionError: {refusal}")),
            (("LOCAL_RANK", "3"), {"rank": 2}, core.format(2, 3, "RuntimeError: neuron: invalid device index 3: "
                                                           "there are 1 neuron devices (set "
                                                           "OPTIMUM_NEURON_TORCH_DEVICE_COUNT for more)"))):
        monkeypatch.setenv(*env)
        fake_dist(monkeypatch, **kwargs)
        error = refused(errors.ConfigurationError, lambda: sharding.start(config), message)
        assert error.__cause__ is kwargs.get("init_error")
    fake_dist(monkeypatch, init_error=AssertionError("another assertion"))
    refused(AssertionError, lambda: sharding.start(config), "another assertion")  # (not TorchNeuron's: as it is)

    outcomes, gather = [], mock.Mock(side_effect=lambda outcome, what: list(outcomes))
    monkeypatch.setattr(sharding, "object_collectives", SimpleNamespace(all_gather=gather))
    fake_dist(monkeypatch, initialized=True, world=1)  # a group of one: nothing to gather
    own = "bad file\nsecond line"
    refused(ValueError, lambda: sharding.agree("loading", ValueError(own)), own)
    assert sharding.agree("loading", None) is None and not gather.called
    fake_dist(monkeypatch, initialized=True, world=3, rank=0)
    outcomes[:] = [None, None, None]
    assert sharding.agree("loading", None) is None and gather.call_args == mock.call(None, what="loading")
    refused(ValueError, lambda: sharding.agree("loading", ValueError(own)), own)
    assert gather.call_args == mock.call("ValueError: bad file", what="loading")  # its own error, then raised
    outcomes[:] = [None, "OSError: gone", "KeyError: 'x'"]
    refused(errors.RankFailedError, lambda: sharding.agree("reading its pieces", None), "rank 0 stops reading its "
            "pieces: rank 1 failed: OSError: gone; rank 2 failed: KeyError: 'x'")


def test_register_registers_the_backend_and_the_kernel_as_torchneuron_does(monkeypatch):
    # (the import registered them already: the registration is run again here against recorders)
    calls = []
    monkeypatch.setattr(distributed, "_host_view", None)
    monkeypatch.setattr(dist.Backend, "register_backend", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(torch.library, "impl", lambda *args: calls.append((args, {})))
    monkeypatch.setattr(dist, "is_available", lambda: False)
    distributed.register(on)  # without torch.distributed: nothing
    assert calls == [] and distributed._host_view is None
    monkeypatch.setattr(dist, "is_available", lambda: True)
    distributed.register(on)
    assert distributed._host_view is on
    assert calls == [(("neuron", distributed._create_process_group), {"devices": ["neuron"]}),
                     (("_c10d_functional::all_gather_into_tensor_out", "PrivateUse1",
                       distributed._all_gather_into_tensor_out), {})]
    distributed.register(zeros)  # idempotent
    assert len(calls) == 2 and distributed._host_view is on


def test_the_second_of_two_ranks_loads_its_piece_of_each_split_parameter_without_a_collective(tmp_path):
    """`stream_into` on rank 1 of 2 (PyTorch's fake process group: this process plays rank 1 alone): each
    parameter split by rows or columns gets this rank's piece, read from the checkpoint and kept as a
    DTensor of its mesh, placements and global shape; replicated and plain tensors get the whole. Loading
    runs no collective (DTensor's `run_check` would gather every piece from the other ranks)."""
    dist.init_process_group("neuron:fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("neuron", (2,))
        full = {"rows": torch.arange(24.0).reshape(4, 6), "columns": torch.arange(24.0, 48.0).reshape(4, 6),
                "replicated": torch.arange(5.0), "plain": torch.arange(3.0)}
        save_file(full, tmp_path / "model.safetensors")
        layer = torch.nn.Module()
        placements = {"rows": Shard(0), "columns": Shard(1), "replicated": Replicate()}
        for name, tensor in full.items():
            value = torch.empty(tensor.shape, device="meta")
            if name in placements:  # (rank 1's piece on meta, as Transformers' split leaves it)
                piece = value.tensor_split(2, placements[name].dim)[1] if name != "replicated" else value
                value = DTensor.from_local(piece, mesh, [placements[name]], run_check=False, shape=tensor.shape,
                                           stride=tensor.stride())
            layer.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
        with SafetensorsFile(tmp_path / "model.safetensors") as file, CommDebugMode() as communication:
            stream_into(layer, _Plan(targets={name: (file, name) for name in full}), torch.device("neuron", 0), "m")
        assert communication.get_total_counts() == 0
        for name, placement in placements.items():
            value = getattr(layer, name)
            assert isinstance(value, DTensor) and value.device_mesh is mesh and value.placements == (placement,), name
            assert value.shape == full[name].shape and value.stride() == full[name].stride(), name
        assert torch.equal(layer.rows.to_local().cpu(), full["rows"][2:])
        assert torch.equal(layer.columns.to_local().cpu(), full["columns"][:, 3:])
        assert torch.equal(layer.replicated.to_local().cpu(), full["replicated"])
        assert not isinstance(layer.plain, DTensor) and torch.equal(layer.plain.cpu(), full["plain"])
        assert layer.plain.device.type == layer.rows.to_local().device.type == "neuron"
    finally:
        dist.destroy_process_group()
