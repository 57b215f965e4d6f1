"""Programs that tests/test_distributed.py launches on several processes (torchrun, or one process per rank).

`python tests/distributed_programs.py OUT PROGRAM [PROGRAM...]` runs each program on this rank and
writes `OUT/rank<r>.json`: every check made, with its name and the failure message if it failed. Each
check compares what the `neuron` process group computed with the same computation done by this one
process on the CPU (every rank can build every rank's inputs: they are functions of the rank).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import optimum_neuron_torch  # noqa: F401  (activates the neuron device and registers its process group)

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
LOCAL_RANK = int(os.environ["LOCAL_RANK"])
DEVICE = torch.device("neuron", LOCAL_RANK)
CHECKS: list[dict] = []
CURRENT = {"program": ""}


def record(name: str, ok: bool, error: str = "", **details) -> None:
    """Notes one check of the current program (`error` says what went wrong)."""
    CHECKS.append({"program": CURRENT["program"], "name": name, "ok": ok, "error": error[:3000], **details})


def check(name: str, actual, expected, **tolerances) -> None:
    """Records whether `actual` (from the device) equals `expected` (computed on the CPU)."""
    try:
        if isinstance(expected, torch.Tensor):
            assert isinstance(actual, torch.Tensor), f"got {type(actual).__name__}"
            assert actual.device.type in ("neuron", "cpu")
            torch.testing.assert_close(actual.cpu(), expected.cpu(), **tolerances)
        else:
            assert actual == expected, f"{actual!r} != {expected!r}"
        record(name, True)
    except Exception as error:  # noqa: BLE001 (recorded for the test to report)
        record(name, False, f"{type(error).__name__}: {error}")


def check_raises(name: str, fn, error_type: type, *fragments: str) -> None:
    """Records whether `fn()` raises `error_type` with every fragment in its message."""
    try:
        fn()
    except error_type as error:
        missing = [fragment for fragment in fragments if fragment not in str(error)]
        record(name, not missing, f"missing {missing} in: {error}")
        return
    except Exception as error:  # noqa: BLE001
        record(name, False, f"raised {type(error).__name__}: {error}")
        return
    record(name, False, "did not raise")


def data(rank: int, shape=(3, 5), dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    """Rank `rank`'s input: distinct per rank, exact in every dtype (small integers)."""
    values = torch.arange(int(torch.Size(shape).numel())).reshape(shape) % 7 + rank * 3 + salt + 1
    return values.to(dtype)


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(DEVICE)


# ---- programs ----------------------------------------------------------------------------------

def program_device() -> None:
    """One device per rank: its index, count and memory statistics."""
    check("device_count is LOCAL_WORLD_SIZE", torch.neuron.device_count(), int(os.environ["LOCAL_WORLD_SIZE"]))
    check("current device is LOCAL_RANK", torch.neuron.current_device(), LOCAL_RANK)
    torch.accelerator.set_device_index(LOCAL_RANK)
    check("set_device_index", torch.accelerator.current_device_index(), LOCAL_RANK)
    check("default backend (init_process_group() without a backend)", dist.get_backend_config(), "neuron:neuron")
    before = [torch.neuron.memory_allocated(i) for i in range(WORLD)]
    block = torch.empty(1 << 20, dtype=torch.uint8, device="neuron")
    after = [torch.neuron.memory_allocated(i) for i in range(WORLD)]
    check("allocation counted on the rank's own device", [a - b for a, b in zip(after, before, strict=True)],
          [(1 << 20) if i == LOCAL_RANK else 0 for i in range(WORLD)])
    check("tensor lands on the rank's device", block.device.index, LOCAL_RANK)
    del block
    from optimum_neuron_torch.commands.env import environment_report, render_text

    report = environment_report()
    distributed = report["distributed"]
    check("env reports the job", (distributed["backend"], distributed["rank"], distributed["world_size"],
                                  distributed["local_rank"], distributed["device"]),
          ("neuron", RANK, WORLD, LOCAL_RANK, f"neuron:{LOCAL_RANK}"))
    check("env text names rank and world size",
          f"rank {RANK} of {WORLD}, local rank {LOCAL_RANK} of {WORLD} on neuron:{LOCAL_RANK}" in render_text(report),
          True)


def program_collectives() -> None:
    """Every collective, against the same reduction on the CPU."""
    ranks = range(WORLD)
    reductions = {dist.ReduceOp.SUM: lambda xs: torch.stack(xs).sum(0),
                  dist.ReduceOp.MAX: lambda xs: torch.stack(xs).amax(0),
                  dist.ReduceOp.MIN: lambda xs: torch.stack(xs).amin(0),
                  dist.ReduceOp.PRODUCT: lambda xs: torch.stack(xs).prod(0)}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8, torch.int8):
        for op, reduce in reductions.items():
            if dtype in (torch.uint8, torch.int8) and op == dist.ReduceOp.PRODUCT:
                continue  # overflows
            tensor = on_device(data(RANK, dtype=dtype))
            dist.all_reduce(tensor, op=op)
            check(f"all_reduce {op.name} {dtype}", tensor, reduce([data(r, dtype=dtype) for r in ranks]).to(dtype))
    for dtype in (torch.float32, torch.bfloat16):
        tensor = on_device(data(RANK, dtype=dtype))
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
        check(f"all_reduce AVG {dtype}", tensor, (sum(data(r) for r in ranks) / WORLD).to(dtype))
    tensor = on_device(data(RANK))
    dist.all_reduce(tensor, op=dist._make_nccl_premul_sum(0.5))
    check("all_reduce PREMUL_SUM", tensor, sum(data(r) for r in ranks) * 0.5)

    # in place and aliasing: a slice of a larger tensor is reduced where it lies, the rest untouched
    base = on_device(torch.zeros(4, 5))
    base[1:3] = on_device(data(RANK, (2, 5)))
    view = base[1:3]
    work = dist.all_reduce(view, async_op=True)
    work.wait()
    expected = torch.zeros(4, 5)
    expected[1:3] = sum(data(r, (2, 5)) for r in ranks)
    check("all_reduce of a view writes through to its base", base, expected)
    check("async work result is the device tensor", work.result()[0].data_ptr(), view.data_ptr())
    tensor = on_device(data(RANK))
    future = dist.all_reduce(tensor, async_op=True).get_future()
    value = future.wait()
    check("future value is the device tensor", (value[0].device.type, value[0].data_ptr()),
          ("neuron", tensor.data_ptr()))
    check("future result", tensor, sum(data(r) for r in ranks))

    tensors = [on_device(data(RANK, (2, 3))), on_device(data(RANK, (5,), salt=1))]
    dist.all_reduce_coalesced(tensors)
    check("all_reduce_coalesced [0]", tensors[0], sum(data(r, (2, 3)) for r in ranks))
    check("all_reduce_coalesced [1]", tensors[1], sum(data(r, (5,), salt=1) for r in ranks))

    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        outputs = [on_device(torch.zeros(3, 5, dtype=dtype)) for _ in ranks]
        dist.all_gather(outputs, on_device(data(RANK, dtype=dtype)))
        check(f"all_gather {dtype}", torch.stack([o.cpu() for o in outputs]),
              torch.stack([data(r, dtype=dtype) for r in ranks]))
    output = on_device(torch.zeros(WORLD * 3, 5))
    dist.all_gather_into_tensor(output, on_device(data(RANK)))
    check("all_gather_into_tensor", output, torch.cat([data(r) for r in ranks]))
    output = on_device(torch.zeros(WORLD, 3, 5))
    dist.all_gather_into_tensor(output, on_device(data(RANK)))
    check("all_gather_into_tensor stacked", output, torch.stack([data(r) for r in ranks]))
    outputs = [[on_device(torch.zeros(2, 3)), on_device(torch.zeros(4))] for _ in ranks]  # [rank][tensor]
    dist.all_gather_coalesced(outputs, [on_device(data(RANK, (2, 3))), on_device(data(RANK, (4,), salt=2))])
    check("all_gather_coalesced",
          torch.cat([torch.cat([t.cpu().reshape(-1) for t in per_rank]) for per_rank in outputs]),
          torch.cat([torch.cat([data(r, (2, 3)).reshape(-1), data(r, (4,), salt=2)]) for r in ranks]))

    tensor = on_device(data(RANK))
    dist.broadcast(tensor, src=WORLD - 1)
    check("broadcast", tensor, data(WORLD - 1))
    for op, reduce in ((dist.ReduceOp.SUM, reductions[dist.ReduceOp.SUM]),
                       (dist.ReduceOp.MAX, reductions[dist.ReduceOp.MAX])):
        tensor = on_device(data(RANK))
        dist.reduce(tensor, dst=1 % WORLD, op=op)
        if RANK == 1 % WORLD:
            check(f"reduce {op.name}", tensor, reduce([data(r) for r in ranks]))

    output = on_device(torch.zeros(3, 5))
    dist.reduce_scatter(output, [on_device(data(RANK, salt=d)) for d in ranks])
    check("reduce_scatter", output, sum(data(r, salt=RANK) for r in ranks))
    output = on_device(torch.zeros(3, 5))
    dist.reduce_scatter_tensor(output, on_device(torch.cat([data(RANK, salt=d) for d in ranks])))
    check("reduce_scatter_tensor", output, sum(data(r, salt=RANK) for r in ranks))
    output = on_device(torch.zeros(3, 5))
    dist.reduce_scatter_tensor(output, on_device(torch.cat([data(RANK, salt=d) for d in ranks])),
                               op=dist.ReduceOp.MAX)
    check("reduce_scatter_tensor MAX", output, torch.stack([data(r, salt=RANK) for r in ranks]).amax(0))
    output = on_device(torch.zeros(3, 5))
    dist.reduce_scatter_tensor(output, on_device(torch.cat([data(RANK, salt=d) for d in ranks])),
                               op=dist._make_nccl_premul_sum(2.0))
    check("reduce_scatter_tensor PREMUL_SUM", output, 2.0 * sum(data(r, salt=RANK) for r in ranks))

    dist.barrier()
    check("barrier", True, True)

    # all_to_all with uneven pieces: rank r sends (r + d + 1) rows of 3 to rank d
    inputs = [on_device(data(RANK, (RANK + d + 1, 3), salt=d)) for d in ranks]
    outputs = [on_device(torch.zeros(s + RANK + 1, 3)) for s in ranks]
    dist.all_to_all(outputs, inputs)
    check("all_to_all uneven", torch.cat([o.cpu() for o in outputs]),
          torch.cat([data(s, (s + RANK + 1, 3), salt=RANK) for s in ranks]))
    send_splits = [RANK + d + 1 for d in ranks]
    receive_splits = [s + RANK + 1 for s in ranks]
    output = on_device(torch.zeros(sum(receive_splits), 3))
    dist.all_to_all_single(output, on_device(torch.cat([data(RANK, (RANK + d + 1, 3), salt=d) for d in ranks])),
                           receive_splits, send_splits)
    check("all_to_all_single uneven", output, torch.cat([data(s, (s + RANK + 1, 3), salt=RANK) for s in ranks]))
    output = on_device(torch.zeros(WORLD * 2, 3))
    dist.all_to_all_single(output, on_device(data(RANK, (WORLD * 2, 3))))
    check("all_to_all_single even", output,
          torch.cat([data(s, (WORLD * 2, 3))[2 * RANK:2 * RANK + 2] for s in ranks]))

    gather_list = [on_device(torch.zeros(3, 5)) for _ in ranks] if RANK == 0 else None
    dist.gather(on_device(data(RANK)), gather_list, dst=0)
    if RANK == 0:
        check("gather", torch.stack([g.cpu() for g in gather_list]), torch.stack([data(r) for r in ranks]))
    output = on_device(torch.zeros(3, 5))
    dist.scatter(output, [on_device(data(d, salt=9)) for d in ranks] if RANK == 0 else None, src=0)
    check("scatter", output, data(RANK, salt=9))

    # point to point, around the ring
    received = on_device(torch.zeros(3, 5))
    requests = [dist.isend(on_device(data(RANK)), (RANK + 1) % WORLD), dist.irecv(received, (RANK - 1) % WORLD)]
    for request in requests:
        request.wait()
    check("send/recv ring", received, data((RANK - 1) % WORLD))

    objects = [None] * WORLD
    dist.all_gather_object(objects, {"rank": RANK})
    check("all_gather_object", objects, [{"rank": r} for r in ranks])

    # the functional collectives (what DTensor and compiled graphs call)
    group = dist.group.WORLD
    x = on_device(data(RANK))
    check("funcol all_reduce", funcol.all_reduce(x, "sum", group), sum(data(r) for r in ranks))
    check("funcol all_gather_tensor", funcol.all_gather_tensor(x, 0, group), torch.cat([data(r) for r in ranks]))
    check("funcol reduce_scatter_tensor",
          funcol.reduce_scatter_tensor(on_device(torch.cat([data(RANK, salt=d) for d in ranks])), "sum", 0, group),
          sum(data(r, salt=RANK) for r in ranks))
    check("funcol all_to_all_single", funcol.all_to_all_single(on_device(data(RANK, (WORLD * 2, 3))), None, None,
                                                                 group),
          torch.cat([data(s, (WORLD * 2, 3))[2 * RANK:2 * RANK + 2] for s in ranks]))
    check("funcol broadcast", funcol.broadcast(x, 0, group), data(0))
    pair = funcol.all_reduce_coalesced([x, on_device(data(RANK, (4,)))], "max", group)
    check("funcol all_reduce_coalesced", pair[1], torch.stack([data(r, (4,)) for r in ranks]).amax(0))
    pair = funcol.all_gather_into_tensor_coalesced([x, on_device(data(RANK, (4,)))], group)
    check("funcol all_gather_into_tensor_coalesced", pair[1], torch.cat([data(r, (4,)) for r in ranks]))
    pair = funcol.reduce_scatter_tensor_coalesced(
        [on_device(torch.cat([data(RANK, (2,), salt=d) for d in ranks])), x.repeat(WORLD, 1)], "sum",
        [0, 0], group)
    check("funcol reduce_scatter_tensor_coalesced", pair[0], sum(data(r, (2,), salt=RANK) for r in ranks))
    check("funcol results are device tensors", funcol.all_reduce(x, "sum", group).device.type, "neuron")


def program_argument_errors() -> None:
    """Mistakes a user makes get an error naming the tensor at fault."""
    from optimum_neuron_torch.errors import CollectiveArgumentError

    check_raises("CPU tensor refused", lambda: dist.all_reduce(torch.ones(3)), CollectiveArgumentError,
                 "tensors[0] is on cpu", "neuron")
    check_raises("wrong output size", lambda: dist.all_gather_into_tensor(on_device(torch.zeros(5)),
                                                                          on_device(torch.ones(3))),
                 CollectiveArgumentError, "output has 5 elements", f"expected {3 * WORLD}")
    check_raises("wrong output list", lambda: dist.all_gather([on_device(torch.zeros(2))] * WORLD,
                                                              on_device(torch.ones(3))),
                 CollectiveArgumentError, "output[0] has shape (2,)", "expected (3,)")
    check_raises("split sizes that do not add up",
                 lambda: dist.all_to_all_single(on_device(torch.zeros(WORLD)), on_device(torch.ones(WORLD)),
                                                [1] * WORLD, [2] * WORLD),
                 CollectiveArgumentError, "input_split_sizes", f"has {WORLD} rows")
    if torch.neuron.device_count() > 1:
        other = (LOCAL_RANK + 1) % torch.neuron.device_count()
        check_raises("tensors on two devices",
                     lambda: dist.all_reduce_coalesced([on_device(torch.ones(2)),
                                                        torch.ones(2, device=f"neuron:{other}")]),
                     CollectiveArgumentError, "several devices", f"neuron:{other}")
    # the group still works after refusals: nothing was sent
    tensor = on_device(torch.ones(2))
    dist.all_reduce(tensor)
    check("group usable after refusals", tensor, torch.full((2,), float(WORLD)))


def program_dtensor() -> None:
    """DeviceMesh and DTensor on neuron: 1-D and (with 4 ranks) 2-D meshes, redistribution, random ops."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    full = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8)
    mesh = init_device_mesh("neuron", (WORLD,))
    sharded = distribute_tensor(full.to("neuron"), mesh, [Shard(0)])
    check("distribute_tensor Shard(0) local shard", sharded.to_local(), full.chunk(WORLD)[RANK])
    check("local shard on the rank's device", sharded.to_local().device, DEVICE)
    check("full_tensor", sharded.full_tensor(), full)
    check("redistribute Shard(0) -> Shard(1)", sharded.redistribute(mesh, [Shard(1)]).to_local(),
          full.chunk(WORLD, dim=1)[RANK])
    check("redistribute Shard -> Replicate", sharded.redistribute(mesh, [Replicate()]).to_local(), full)
    replicated = distribute_tensor(full.to("neuron"), mesh, [Replicate()])
    check("redistribute Replicate -> Shard", replicated.redistribute(mesh, [Shard(0)]).to_local(),
          full.chunk(WORLD)[RANK])
    partial = DTensor.from_local(on_device(data(RANK, (4, 4))), mesh, [Partial()])
    check("redistribute Partial -> Replicate", partial.redistribute(mesh, [Replicate()]).to_local(),
          sum(data(r, (4, 4)) for r in range(WORLD)))
    check("DTensor matmul", (sharded @ replicated.T).full_tensor(), full @ full.T)

    if WORLD == 4:
        mesh2 = init_device_mesh("neuron", (2, 2), mesh_dim_names=("dp", "tp"))
        both = distribute_tensor(full.to("neuron"), mesh2, [Shard(0), Shard(1)])
        dp, tp = RANK // 2, RANK % 2
        check("2-D mesh Shard(0), Shard(1)", both.to_local(), full.chunk(2)[dp].chunk(2, dim=1)[tp])
        check("2-D mesh full_tensor", both.full_tensor(), full)
        check("2-D mesh sub-mesh", mesh2["tp"].size(), 2)
        row = distribute_tensor(full.to("neuron"), mesh2, [Replicate(), Shard(0)])
        check("2-D mesh redistribute", row.redistribute(mesh2, [Shard(0), Replicate()]).to_local(),
              full.chunk(2)[dp])

    torch.manual_seed(1234)
    first = torch.distributed.tensor.rand((8, 6), device_mesh=mesh, placements=[Shard(0)]).full_tensor()
    torch.manual_seed(1234)
    again = torch.distributed.tensor.rand((8, 6), device_mesh=mesh, placements=[Shard(0)]).full_tensor()
    check("DTensor rand reproducible under a seed", again, first)
    # As on TorchNeuron: the op draws from the CPU generator (see tests/test_rng.py), which DTensor's offsets
    # do not move, so under one seed every rank's shard holds the same numbers.
    shards = first.chunk(WORLD)
    check("DTensor rand shards equal, as on TorchNeuron", all(torch.equal(shards[0], s) for s in shards[1:]), True)
    # ... and DTensor forks the random states around each op (torch.random.fork_rng), the CPU's included,
    # so two random ops in a row repeat the same numbers, as on TorchNeuron.
    second = torch.distributed.tensor.rand((8, 6), device_mesh=mesh, placements=[Shard(0)]).full_tensor()
    check("DTensor rand twice in a row: the same numbers, as on TorchNeuron", second, again)
    torch.manual_seed(99)
    replicated = torch.distributed.tensor.rand((4,), device_mesh=mesh, placements=[Replicate()]).to_local()
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, replicated.cpu().tolist())
    check("DTensor rand Replicate equal on every rank", all(g == gathered[0] for g in gathered), True)
    dropped = torch.nn.functional.dropout(distribute_tensor(torch.ones(8, 6, device="neuron"), mesh, [Shard(0)]),
                                          0.5)
    check("DTensor dropout runs", set(dropped.full_tensor().unique().tolist()) <= {0.0, 2.0}, True)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(4 * WORLD, 6, generator=generator), torch.randn(4 * WORLD, 3, generator=generator)


def program_ddp() -> None:
    """DistributedDataParallel on neuron: every rank's parameters equal one CPU process on the whole batch."""
    from torch.nn.parallel import DistributedDataParallel

    reference = _mlp()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    model = DistributedDataParallel(_mlp().to(DEVICE))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        inputs, targets = _batch(step)
        reference_optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(inputs), targets).backward()
        reference_optimizer.step()
        mine = slice(4 * RANK, 4 * RANK + 4)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs[mine].to(DEVICE)), targets[mine].to(DEVICE)).backward()
        if step == 0:
            check("DDP gradients equal the whole-batch CPU gradients",
                  [p.grad.cpu() for p in model.parameters()][0], [p.grad for p in reference.parameters()][0],
                  atol=1e-6, rtol=1e-5)
        optimizer.step()
    for (name, parameter), expected in zip(model.module.named_parameters(), reference.parameters(), strict=True):
        check(f"DDP parameter {name} after 3 steps", parameter, expected.detach(), atol=1e-6, rtol=1e-5)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def program_fsdp() -> None:
    """FSDP2 `fully_shard` of a tiny Llama: parameters equal one CPU process within 5e-5, and a sharded
    checkpoint saved and loaded with torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    reference = _tiny_llama()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model = _tiny_llama().to(DEVICE)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    check("FSDP2 parameters are sharded DTensors",
          all(isinstance(p, DTensor) for p in model.parameters()), True)
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        ids = torch.randint(0, 64, (2 * WORLD, 12), generator=generator)
        reference_optimizer.zero_grad()
        reference(input_ids=ids, labels=ids).loss.backward()
        reference_optimizer.step()
        mine = ids[2 * RANK:2 * RANK + 2].to(DEVICE)
        optimizer.zero_grad()
        model(input_ids=mine, labels=mine).loss.backward()
        optimizer.step()
    worst = max((p.full_tensor().cpu() - q.detach()).abs().max().item()
                for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    # AdamW divides by sqrt(v): where a gradient is near zero, the last bits that the ranks' reduction order
    # changes move the parameter by a visible fraction of the learning rate (measured: 1.01e-5 after 3 steps with
    # torch 2.13.0; a sharding error moves parameters by ~1e-2).
    check("FSDP2 parameters equal the CPU run within 5e-5", worst <= 5e-5, True)

    directory = Path(sys.argv[1]) / "fsdp_checkpoint"
    dcp.save(get_model_state_dict(model), checkpoint_id=str(directory))
    fresh = _tiny_llama().to(DEVICE)
    for layer in fresh.model.layers:
        fully_shard(layer)
    fully_shard(fresh)
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=str(directory))
    set_model_state_dict(fresh, state)
    worst = max((p.full_tensor() - q.full_tensor()).abs().max().item()
                for p, q in zip(fresh.parameters(), model.parameters(), strict=True))
    check("FSDP2 sharded checkpoint round trip", worst, 0.0)
    check("checkpoint saved one shard file per rank", len(list(directory.glob("*.distcp"))), WORLD)


def program_compiled() -> None:
    """A functional collective inside a graph compiled with backend="neuron" gives the eager result,
    and the graph goes through the compile cache."""
    from optimum_neuron_torch.compiler import cache_stats

    group = dist.group.WORLD

    def step(x: torch.Tensor) -> torch.Tensor:
        reduced = funcol.all_reduce(x * 2.0, "sum", group)
        return torch.tanh(reduced) + funcol.all_gather_tensor(x, 0, group).sum(0)

    x = on_device(data(RANK, (WORLD, 5)) / 10)
    eager = step(x)
    before = cache_stats()
    compiled = torch.compile(step, backend="neuron", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = compiled(x)
    check("compiled collective equals eager", result, eager.cpu(), atol=1e-6, rtol=1e-6)
    check("the collectives stay in the compiled graph (no split)",
          [str(w.message)[:200] for w in caught if "graph split" in str(w.message)], [])
    check("compiled collective equals the CPU computation", compiled(x),
          torch.tanh(sum(data(r, (WORLD, 5)) / 10 * 2 for r in range(WORLD))) +
          torch.cat([data(r, (WORLD, 5)) / 10 for r in range(WORLD)]).sum(0), atol=1e-6, rtol=1e-6)
    after = cache_stats()
    check("the graph went through the compile cache", (after.hits + after.misses) > (before.hits + before.misses),
          True)


def program_raise() -> None:
    """Rank 1 raises; the others are inside a collective and must fail naming it."""
    if RANK == 1:
        raise RuntimeError("rank 1 fails on purpose")
    _wait_in_all_reduce()


def program_kill() -> None:
    """Rank 1 is killed (SIGKILL); the others must fail naming it."""
    if RANK == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _wait_in_all_reduce()


def program_stall() -> None:
    """Rank 1 stays alive but never joins; the others must fail at the process group's timeout."""
    if RANK == 1:
        report = Path(sys.argv[1]) / "rank0.json"
        deadline = time.monotonic() + 60
        while not report.exists() and time.monotonic() < deadline:  # alive until rank 0 has reported
            time.sleep(0.1)
        return
    _wait_in_all_reduce()


def _wait_in_all_reduce() -> None:
    from optimum_neuron_torch.errors import CollectiveError

    start = time.monotonic()
    try:
        dist.all_reduce(on_device(torch.ones(4)))
    except CollectiveError as error:
        record("collective failed", True, str(error), seconds=time.monotonic() - start,
               failed_ranks=error.failed_ranks)
        return
    record("collective failed", False, "all_reduce returned")


PROGRAMS = {name[len("program_"):]: value for name, value in globals().items() if name.startswith("program_")}


def run_programs(programs: dict[str, Callable[[], None]], names: list[str], out: Path,
                 reraise: tuple[str, ...] = ()) -> None:
    """Runs the named programs on this rank and writes `OUT/rank<r>.json`. A program that raises is
    recorded as a failed check and the next one runs; those in `reraise` end the process too."""
    try:
        for name in names:
            CURRENT["program"] = name
            try:
                programs[name]()
            except Exception:  # noqa: BLE001 (recorded, the other programs still run)
                record(f"{name} raised", False, traceback.format_exc()[-3000:])
                if name in reraise:
                    raise
    finally:
        (out / f"rank{RANK}.json").write_text(json.dumps(CHECKS, indent=1))


def main() -> None:
    out, programs = Path(sys.argv[1]), sys.argv[2:]
    timeout = float(os.environ.get("NEURON_TEST_PG_TIMEOUT", "120"))
    dist.init_process_group(timeout=timedelta(seconds=timeout))  # no backend named: `neuron` is the default
    run_programs(PROGRAMS, programs, out, reraise=("raise", "kill", "stall"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
