"""TorchNeuron's c10d backend `"neuron"`, simulated over gloo.

`init_process_group("neuron")` creates a `ProcessGroupNeuron`, a Python `ProcessGroup` as TorchNeuron's
is. Each collective copies its device tensors to the CPU, runs the same collective on a gloo process
group created over the same store, and copies the results back; the work it returns is complete.
TorchNeuron runs each collective as an XLA program compiled for its op, shapes and dtypes and cached
by them (`python_ops/xla_builder/kernel.py`, `_generate_cache_key`, `_get_or_compile_neff`): the
programs a process would compile are recorded in `_compiled_collectives` (for tests). Its barrier
exists for the default group only (`distributed/backend.py`, `barrier`: NotImplementedError).
The first process group sets the process up as TorchNeuron does: one NeuronCore per process
(NEURON_RT_VISIBLE_CORES=LOCAL_RANK unless set), NEURON_RT_ROOT_COMM_ID from the store, then the
runtime starts; it must not have started before.
"""

from __future__ import annotations

import functools
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ProcessGroup,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    _create_work_from_future,
)
from torch.distributed.constants import default_pg_timeout

import torch_neuronx

_WORLD_SIZE = None

# (op, ((shape, dtype), ...), group name) of every collective program TorchNeuron would have compiled.
_compiled_collectives: set = set()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _neuron_runtime_setup(rank: int, size: int, store) -> None:
    """One core per process, the root communicator's address, then the runtime starts."""
    assert not torch_neuronx.is_neuron_runtime_initialized(), (
        "Neuron runtime should not be initialized before the init_process_group."
    )
    # TorchNeuron finds the local rank through the store (workers sharing a host IP); the stand-in's
    # processes all run on one host, so the global rank is the local one unless LOCAL_RANK says otherwise.
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if not os.environ.get("NEURON_RT_VISIBLE_CORES"):
        os.environ["NEURON_RT_VISIBLE_CORES"] = str(local_rank)
    if os.environ.get("NEURON_RT_ROOT_COMM_ID") is None:
        if rank == 0:
            store.set("NEURON_RT_PORT", str(_free_port()))
        port = store.get("NEURON_RT_PORT").decode()
        os.environ["NEURON_RT_ROOT_COMM_ID"] = f"{os.environ.get('MASTER_ADDR', 'localhost')}:{port}"
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    torch_neuronx._lazy_init()
    assert torch_neuronx._vnc_count() == 1, "Attempted to have more than one device per process in distributed setup"
    torch_neuronx._set_local_devices(local_world_size, local_rank)


def _done(result) -> dist.Work:
    """A work object that has already completed with `result`."""
    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu() if tensor.device.type != "cpu" else tensor


def _hosts(tensors):
    return [_host(t) for t in tensors]


def _copy_back(devices, hosts) -> None:
    for device, host in zip(devices, hosts, strict=True):
        if device is not host:
            device.copy_(host)


def _as_list(tensors):
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _flat(value):
    """The tensors in `value` (a tensor, or lists of them; anything else holds none)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _flat(item)]
    return []


def _compiled(collective):
    """Records the program TorchNeuron would compile (or take from its cache) for each call: one per
    op, tensor shapes and dtypes, and group."""
    @functools.wraps(collective)
    def run(self, *args, **kwargs):
        signature = tuple((tuple(t.shape), str(t.dtype)) for t in _flat(args))
        _compiled_collectives.add((collective.__name__, signature, self._group_name))
        return collective(self, *args, **kwargs)
    return run


class ProcessGroupNeuron(ProcessGroup):
    """The `neuron` process group: collectives of neuron (or CPU) tensors, computed by gloo on the host."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta | None):
        super().__init__(rank, size)
        global _WORLD_SIZE
        if _WORLD_SIZE is None:
            _WORLD_SIZE = size
            _neuron_runtime_setup(rank, size, store)
        self._timeout = timeout or default_pg_timeout
        self._group_name = ""
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("torch_neuronx_standin", store), rank, size, self._timeout)

    def getBackendName(self) -> str:
        return "neuron"

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def _get_backend(self, device):
        return self

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def _device_types(self):
        return [torch.device("neuron")]

    def shutdown(self) -> None:
        """Stops the stand-in's gloo threads (`destroy_process_group` calls this): a gloo group left to the
        interpreter's exit (this group held by a DeviceMesh, say) can free tensors from its worker threads
        after Python has gone, and the process aborts."""
        self._gloo.shutdown()

    def abort(self) -> None:
        self._gloo.abort()

    # ---- collectives: host copies in, gloo, copies back ----

    @_compiled
    def allreduce(self, tensors, opts=None):
        tensors = _as_list(tensors)
        if not isinstance(opts, AllreduceOptions):
            reduce_op = opts if opts is not None else dist.ReduceOp.SUM
            opts = AllreduceOptions()
            opts.reduceOp = reduce_op
        hosts = _hosts(tensors)
        self._gloo.allreduce(hosts, opts).wait()
        _copy_back(tensors, hosts)
        return _done(tensors)

    @_compiled
    def allreduce_coalesced(self, tensors, opts=None):
        hosts = _hosts(tensors)
        self._gloo.allreduce_coalesced(hosts, opts or AllreduceCoalescedOptions()).wait()
        _copy_back(tensors, hosts)
        return _done(tensors)

    @_compiled
    def broadcast(self, tensors, opts=None):
        tensors = _as_list(tensors)
        hosts = _hosts(tensors)
        self._gloo.broadcast(hosts, opts or BroadcastOptions()).wait()
        _copy_back(tensors, hosts)
        return _done(tensors)

    @_compiled
    def reduce(self, tensors, opts=None):
        tensors = _as_list(tensors)
        hosts = _hosts(tensors)
        self._gloo.reduce(hosts, opts or ReduceOptions()).wait()
        _copy_back(tensors, hosts)
        return _done(tensors)

    @_compiled
    def allgather(self, output_tensors, input_tensors, opts=None):
        out_hosts = [_hosts(outputs) for outputs in output_tensors]
        self._gloo.allgather(out_hosts, _hosts(input_tensors), opts or AllgatherOptions()).wait()
        for outputs, hosts in zip(output_tensors, out_hosts, strict=True):
            _copy_back(outputs, hosts)
        return _done(output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    @_compiled
    def _allgather_base(self, output, input, opts=None):
        out_host = _host(output)
        self._gloo._allgather_base(out_host, _host(input), opts or AllgatherOptions()).wait()
        _copy_back([output], [out_host])
        return _done([output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs, strict=True):
            self._allgather_base(output, input, opts)
        return _done(outputs)

    @_compiled
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        out_hosts = _hosts(output_tensors)
        in_hosts = [_hosts(inputs) for inputs in input_tensors]
        self._gloo.reduce_scatter(out_hosts, in_hosts, opts or ReduceScatterOptions()).wait()
        _copy_back(output_tensors, out_hosts)
        return _done(output_tensors)

    @_compiled
    def _reduce_scatter_base(self, output, input, opts=None):
        out_host = _host(output)
        self._gloo._reduce_scatter_base(out_host, _host(input), opts or ReduceScatterOptions()).wait()
        _copy_back([output], [out_host])
        return _done([output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs, strict=True):
            self._reduce_scatter_base(output, input, opts)
        return _done(outputs)

    @_compiled
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        out_host = _host(output)
        self._gloo.alltoall_base(
            out_host, _host(input), output_split_sizes, input_split_sizes, opts or AllToAllOptions()
        ).wait()
        _copy_back([output], [out_host])
        return _done([output])

    @_compiled
    def alltoall(self, output_tensors, input_tensors, opts=None):
        out_hosts = _hosts(output_tensors)
        self._gloo.alltoall(out_hosts, _hosts(input_tensors), opts or AllToAllOptions()).wait()
        _copy_back(output_tensors, out_hosts)
        return _done(output_tensors)

    @_compiled
    def gather(self, output_tensors, input_tensors, opts=None):
        out_hosts = [_hosts(outputs) for outputs in output_tensors]
        self._gloo.gather(out_hosts, _hosts(input_tensors), opts or GatherOptions()).wait()
        for outputs, hosts in zip(output_tensors, out_hosts, strict=True):
            _copy_back(outputs, hosts)
        return _done(output_tensors)

    @_compiled
    def scatter(self, output_tensors, input_tensors, opts=None):
        out_hosts = _hosts(output_tensors)
        in_hosts = [_hosts(inputs) for inputs in input_tensors]
        self._gloo.scatter(out_hosts, in_hosts, opts or ScatterOptions()).wait()
        _copy_back(output_tensors, out_hosts)
        return _done(output_tensors)

    @_compiled
    def send(self, tensors, dst_rank, tag=0):
        self._gloo.send(_hosts(tensors), dst_rank, tag).wait()
        return _done(tensors)

    @_compiled
    def recv(self, tensors, src_rank, tag=0):
        hosts = _hosts(tensors)
        self._gloo.recv(hosts, src_rank, tag).wait()
        _copy_back(tensors, hosts)
        return _done(tensors)

    # torch 2.13's torch.distributed calls these names; they are the tensor forms above.
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    def barrier(self, opts=None):
        if dist.get_world_size() != self.size():
            raise NotImplementedError(f"Barrier is implemented only for default group, called barrier on {self}")
        # gloo's barrier takes no device of ours: give it a fresh CPU one with the same timeout.
        host_opts = BarrierOptions()
        host_opts.timeout = opts.timeout if opts is not None else self._timeout
        self._gloo.barrier(host_opts).wait()
        return _done(None)


def _create_neuron_process_group(prefix_store, rank, size, timeout):
    return ProcessGroupNeuron(prefix_store, rank, size, timeout)


def _rendezvous_handler():
    """TorchNeuron registers a `neuron://` rendezvous handler that does nothing usable; so does this."""


dist.Backend.register_backend("neuron", _create_neuron_process_group, devices=["neuron"])
dist.register_rendezvous_handler("neuron", _rendezvous_handler)
