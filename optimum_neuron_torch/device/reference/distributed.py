"""The reference device's `neuron` process-group backend: TorchNeuron's collectives, carried by gloo.

`import torch_neuronx` registers a c10d backend named `neuron` (a Python `ProcessGroup` subclass whose
collectives run over the NeuronCores' links). Activating the reference device registers the same
backend the same way, so `init_process_group()` (or `init_process_group("neuron")`) under `torchrun`
works unchanged on any machine. No new transport: each collective hands gloo, the CPU backend shipped
with torch, zero-copy CPU views of the device tensors, so results land in device memory in place.

The process group has the methods of TorchNeuron's `ProcessGroupNeuron` (plus send/recv, which gloo
gives for free), and takes `neuron` tensors only: a CPU tensor is refused with a message, as code
that passed CPU tensors here could not be trusted to run on Trainium.

When a peer fails, gloo reports only a closed connection or a timeout; the process group adds which
ranks have exited (it notes every peer's host and process id when it is created).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

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
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
    Work,
)

from ...errors import CollectiveArgumentError, CollectiveError, first_line
from .collective_work import DoneWork, NeuronWork

BACKEND_NAME = "neuron"
# How long a rank that saw a collective fail waits for a failed peer's process to be gone.
_EXIT_GRACE_SECONDS = 3.0

_host_view: Callable[[torch.Tensor], torch.Tensor] | None = None


def register(host_view: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Registers the `neuron` c10d backend as TorchNeuron does (`devices=["neuron"]` makes it the
    default for `init_process_group()` on a `neuron` machine). Idempotent.

    Args:
        host_view: returns a CPU tensor over the same memory as a `neuron` tensor.
    """
    global _host_view
    if _host_view is not None or not dist.is_available():
        return
    _host_view = host_view
    dist.Backend.register_backend(BACKEND_NAME, _create_process_group, devices=[BACKEND_NAME])
    # As TorchNeuron does: the C++ kernel of this functional collective asks the process group
    # for a C++ backend, which a Python process group does not have.
    torch.library.impl("_c10d_functional::all_gather_into_tensor_out", "PrivateUse1", _all_gather_into_tensor_out)


def _create_process_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> ProcessGroupNeuron:
    return ProcessGroupNeuron(store, rank, size, timeout)


def _all_gather_into_tensor_out(
    input: torch.Tensor, group_size: int, group_name: str, out: torch.Tensor
) -> torch.Tensor:
    group = dist.distributed_c10d._resolve_process_group(group_name)
    group._allgather_base(out, input, AllgatherOptions()).wait()
    return out


# ---- process identity, for naming the rank that failed ----

def _process_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _has_exited(identity: str) -> bool:
    """Whether the process `host:pid` of this host has exited (or is a zombie); False for other hosts."""
    host, _, pid = identity.rpartition(":")
    if host != socket.gethostname():
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class ProcessGroupNeuron(ProcessGroup):
    """TorchNeuron's `neuron` process group on the reference device: collectives of `neuron`
    tensors, carried out by a gloo process group over zero-copy host views.

    Created by `torch.distributed.init_process_group` (and `new_group`, `init_device_mesh`) through
    the registered backend; not meant to be built directly.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._timeout = timeout
        self._group_name = ""
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        # Every peer's host:pid, so that a failure can name the ranks that exited.
        store.set(f"neuron_pg/identity/{rank}", _process_identity())
        self._peers = [store.get(f"neuron_pg/identity/{peer}").decode() for peer in range(size)]

    # ---- what torch.distributed asks of a Python process group ----
    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return BACKEND_NAME

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _get_backend(self, device: torch.device) -> ProcessGroupNeuron:
        return self

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(BACKEND_NAME)]

    def shutdown(self) -> None:
        """Stops gloo's threads now (`destroy_process_group` calls this): left to the interpreter's
        exit, a gloo group still alive can be torn down after its threads' objects (an abort)."""
        self._gloo.shutdown()

    def abort(self) -> None:
        self._gloo.abort()

    def __repr__(self) -> str:
        return f"ProcessGroupNeuron(rank={self.rank()}, size={self.size()}, reference device over gloo)"

    # ---- checks and failures ----
    def _views(self, op: str, name: str, tensors: Iterable[torch.Tensor], device: torch.device | None = None
               ) -> list[torch.Tensor]:
        """Host views of `tensors`, after checking they are `neuron` tensors of one device (`device`
        when given: the op's other tensors'). The common case costs a few attribute reads per tensor."""
        views = []
        for index, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise CollectiveArgumentError(
                    f"{op}: {name}[{index}] is of type {type(tensor).__name__}, not a tensor.")
            if tensor.device != device:
                if tensor.device.type != BACKEND_NAME:
                    raise CollectiveArgumentError(
                        f"{op}: {name}[{index}] is on {tensor.device}, but the `neuron` process group takes neuron "
                        f"tensors only (rank {self.rank()} uses {_rank_device()}). Move it with `.to('neuron')`, "
                        "or create a gloo group for CPU tensors: dist.new_group(backend='gloo')."
                    )
                if device is not None:
                    raise CollectiveArgumentError(
                        f"{op}: the tensors of rank {self.rank()} are on several devices ({device} and "
                        f"{tensor.device}, {name}[{index}]); one process drives one neuron device."
                    )
                device = tensor.device
            views.append(_host_view(tensor))
        return views

    def _flat_views(self, op: str, output: torch.Tensor, input: torch.Tensor) -> list[torch.Tensor]:
        """One-dimensional host views of a collective's output and input: gloo splits the flat
        buffer by rank, whatever the shapes (a stacked [world, ...] output included)."""
        for name, tensor in (("output", output), ("input", input)):
            if not tensor.is_contiguous():
                raise CollectiveArgumentError(
                    f"{op}: the {name} (shape {tuple(tensor.shape)}, strides {tensor.stride()}) is not contiguous on "
                    f"rank {self.rank()}; pass `.contiguous()` (and copy the result back) instead.")
        return [view.view(-1) for view in self._views(op, "tensors", (output, input))]

    def _check_shapes(self, op: str, expected: torch.Size | Sequence[int], pairs: Iterable[tuple[str, torch.Tensor]]
                      ) -> None:
        for name, tensor in pairs:
            if tuple(tensor.shape) != tuple(expected):
                raise CollectiveArgumentError(
                    f"{op}: {name} has shape {tuple(tensor.shape)} on rank {self.rank()}, expected "
                    f"{tuple(expected)}."
                )

    def _check_numel(self, op: str, name: str, tensor: torch.Tensor, numel: int, because: str) -> None:
        if tensor.numel() != numel:
            raise CollectiveArgumentError(
                f"{op}: {name} has {tensor.numel()} elements (shape {tuple(tensor.shape)}) on rank {self.rank()}, "
                f"expected {numel} ({because})."
            )

    def _check_list(self, op: str, name: str, tensors: Sequence[Any]) -> None:
        if len(tensors) != self.size():
            raise CollectiveArgumentError(
                f"{op}: {name} has {len(tensors)} entries on rank {self.rank()}, expected one per rank "
                f"({self.size()})."
            )

    def _check_pairs(self, op: str, name: str, first: Sequence[Any], other_name: str, other: Sequence[Any]) -> None:
        if len(first) != len(other):
            raise CollectiveArgumentError(f"{op}: {len(first)} {name} for {len(other)} {other_name} on rank "
                                          f"{self.rank()}.")

    def _check_root(self, op: str, root: int, role: str = "root") -> None:
        if not 0 <= root < self.size():
            raise CollectiveArgumentError(f"{op}: {role} rank {root} is outside this group of {self.size()} ranks.")

    def _failure(self, op: str, error: BaseException) -> CollectiveError:
        """The error a failed collective raises: gloo's, plus which peers have exited."""
        me = self.rank()
        deadline = time.monotonic() + _EXIT_GRACE_SECONDS
        exited: list[int] = []
        while True:
            exited = [peer for peer, identity in enumerate(self._peers) if peer != me and _has_exited(identity)]
            if exited or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if exited:
            who = f"rank(s) {', '.join(map(str, exited))} of this group exited"
            hint = "see the failed rank's own error (torchrun prints it as the root cause)"
        else:
            who = "no peer process has exited (a peer may be stuck, raised and caught, or on another host)"
            hint = (f"every rank must call the same collectives in the same order; the timeout is "
                    f"{self._timeout} (init_process_group(timeout=...))")
        return CollectiveError(
            f"neuron process group: {op} failed on rank {me} of {self.size()}: {who}; {hint}. gloo said: "
            f"{first_line(error) or type(error).__name__}",
            rank=me, failed_ranks=exited,
        )

    def _run(self, op: str, start: Callable[[], Work], outputs: list[torch.Tensor], views: Sequence[Any],
             after: Callable[[], None] | None = None) -> NeuronWork:
        """Starts gloo's op: a refusal at start is an argument error; a failure at wait names the ranks
        that exited."""
        try:
            inner = start()
        except RuntimeError as error:  # gloo checks its arguments before it sends anything
            raise CollectiveArgumentError(
                f"{op} on rank {self.rank()}: {first_line(error) or type(error).__name__}") from error
        return NeuronWork(inner, self, op, outputs, views, after)

    # ---- reductions ----
    @staticmethod
    def _premul_factor(opts: Any) -> float | None:
        """PREMUL_SUM, which gloo lacks, is done as TorchNeuron does it: the inputs scaled by the
        factor, then a SUM. Returns the factor (None for other ops) and makes `opts` a SUM."""
        if opts.reduceOp != ReduceOp.PREMUL_SUM:
            return None
        factor = opts.reduceOp.__getstate__()[1]
        opts.reduceOp = ReduceOp.SUM
        return factor

    def allreduce(self, tensors: list[torch.Tensor] | torch.Tensor, opts: AllreduceOptions | None = None) -> Work:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        opts = opts or AllreduceOptions()
        views = self._views("all_reduce", "tensors", tensors)
        _scale_in_place(views, self._premul_factor(opts))
        return self._run("all_reduce", lambda: self._gloo.allreduce(views, opts), tensors, views)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | None = None
                            ) -> Work:
        opts = opts or AllreduceCoalescedOptions()
        views = self._views("all_reduce_coalesced", "tensors", tensors)
        _scale_in_place(views, self._premul_factor(opts))
        return self._run("all_reduce_coalesced", lambda: self._gloo.allreduce_coalesced(views, opts), tensors, views)

    def reduce(self, tensors: list[torch.Tensor], opts: ReduceOptions | None = None) -> Work:
        opts = opts or ReduceOptions()
        self._check_root("reduce", opts.rootRank)
        views = self._views("reduce", "tensors", tensors)
        _scale_in_place(views, self._premul_factor(opts))
        return self._run("reduce", lambda: self._gloo.reduce(views, opts), tensors, views)

    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions | None = None) -> Work:
        opts = opts or BroadcastOptions()
        self._check_root("broadcast", opts.rootRank)
        views = self._views("broadcast", "tensors", tensors)
        return self._run("broadcast", lambda: self._gloo.broadcast(views, opts), tensors, views)

    # ---- all_gather ----
    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: AllgatherOptions | None = None) -> Work:
        opts = opts or AllgatherOptions()
        self._check_pairs("all_gather", "output lists", output_lists, "inputs", inputs)
        in_views = self._views("all_gather", "input", inputs)
        out_views = []
        for outputs, tensor in zip(output_lists, inputs, strict=True):
            self._check_list("all_gather", "output list", outputs)
            self._check_shapes("all_gather", tensor.shape, ((f"output[{i}]", out) for i, out in enumerate(outputs)))
            out_views.append(self._views("all_gather", "output", outputs, tensor.device))
        flat = [tensor for outputs in output_lists for tensor in outputs]
        return self._run("all_gather", lambda: self._gloo.allgather(out_views, in_views, opts), flat,
                         (in_views, out_views))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions | None = None
                        ) -> Work:
        opts = opts or AllgatherOptions()
        self._check_numel("all_gather_into_tensor", "output", output, input.numel() * self.size(),
                          f"the input's {input.numel()} times {self.size()} ranks")
        out_view, in_view = self._flat_views("all_gather_into_tensor", output, input)
        return self._run("all_gather_into_tensor", lambda: self._gloo._allgather_base(out_view, in_view, opts),
                         [output], (out_view, in_view))

    all_gather_single = _allgather_base

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: AllgatherOptions | None = None) -> Work:
        opts = opts or AllgatherOptions()
        in_views = self._views("all_gather_coalesced", "input", inputs)
        device = inputs[0].device if inputs else None
        out_views = [self._views("all_gather_coalesced", "output", outputs, device) for outputs in output_lists]
        flat = [tensor for outputs in output_lists for tensor in outputs]
        return self._run("all_gather_coalesced", lambda: self._gloo.allgather_coalesced(out_views, in_views, opts),
                         flat, (in_views, out_views))

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: AllgatherOptions | None = None) -> Work:
        return self._each("all_gather_into_tensor_coalesced", self._allgather_base, outputs, inputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    # ---- reduce_scatter ----
    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: ReduceScatterOptions | None = None) -> Work:
        opts = opts or ReduceScatterOptions()
        self._check_pairs("reduce_scatter", "outputs", outputs, "input lists", input_lists)
        out_views = self._views("reduce_scatter", "output", outputs)
        factor = self._premul_factor(opts)
        in_views = []
        for output, inputs in zip(outputs, input_lists, strict=True):
            self._check_list("reduce_scatter", "input list", inputs)
            self._check_shapes("reduce_scatter", output.shape, ((f"input[{i}]", t) for i, t in enumerate(inputs)))
            in_views.append(_scaled(self._views("reduce_scatter", "input", inputs, output.device), factor))
        return self._run("reduce_scatter", lambda: self._gloo.reduce_scatter(out_views, in_views, opts), outputs,
                         (out_views, in_views))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: ReduceScatterOptions | None = None) -> Work:
        opts = opts or ReduceScatterOptions()
        self._check_numel("reduce_scatter_tensor", "input", input, output.numel() * self.size(),
                          f"the output's {output.numel()} times {self.size()} ranks")
        out_view, in_view = self._flat_views("reduce_scatter_tensor", output, input)
        (in_view,) = _scaled([in_view], self._premul_factor(opts))
        return self._run("reduce_scatter_tensor", lambda: self._gloo._reduce_scatter_base(out_view, in_view, opts),
                         [output], (out_view, in_view))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: ReduceScatterOptions | None = None) -> Work:
        return self._each("reduce_scatter_tensor_coalesced", self._reduce_scatter_base, outputs, inputs, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _each(self, op: str, single: Callable[..., Work], outputs: list[torch.Tensor], inputs: list[torch.Tensor],
              opts: Any) -> Work:
        """A coalesced op as one op per pair (gloo has no coalesced form); one work for all."""
        self._check_pairs(op, "outputs", outputs, "inputs", inputs)
        works = [single(output, input, _copy_options(opts)) for output, input in zip(outputs, inputs, strict=True)]
        if not works:
            return DoneWork(self, op, [])
        *earlier, last = works
        for work in earlier:
            work.wait()
        last._outputs = list(outputs)
        return last

    # ---- all_to_all ----
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: AllToAllOptions | None = None) -> Work:
        opts = opts or AllToAllOptions()
        for name, tensor, splits in (("output", output, output_split_sizes), ("input", input, input_split_sizes)):
            if splits:
                self._check_list("all_to_all_single", f"{name}_split_sizes", splits)
                rows = tensor.shape[0] if tensor.dim() else 1
                if sum(splits) != rows:
                    raise CollectiveArgumentError(
                        f"all_to_all_single: {name}_split_sizes {list(splits)} sum to {sum(splits)} on rank "
                        f"{self.rank()}, but the {name} has {rows} rows (shape {tuple(tensor.shape)}).")
            elif tensor.dim() and tensor.shape[0] % self.size():
                raise CollectiveArgumentError(
                    f"all_to_all_single: the {name}'s {tensor.shape[0]} rows (shape {tuple(tensor.shape)}) do not "
                    f"split evenly over {self.size()} ranks on rank {self.rank()}; pass {name}_split_sizes.")
        out_view, in_view = self._views("all_to_all_single", "tensors", (output, input))
        return self._run("all_to_all_single", lambda: self._gloo.alltoall_base(
            out_view, in_view, output_split_sizes, input_split_sizes, opts), [output], (out_view, in_view))

    all_to_all_single = alltoall_base

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllToAllOptions | None = None
                 ) -> Work:
        """gloo has no list form: one flat all_to_all_single with the list's sizes, then copies out."""
        self._check_list("all_to_all", "output list", outputs)
        self._check_list("all_to_all", "input list", inputs)
        self._views("all_to_all", "output", outputs)
        in_views = self._views("all_to_all", "input", inputs, outputs[0].device)
        dtypes = {tensor.dtype for tensor in (*outputs, *inputs)}
        if len(dtypes) > 1:
            raise CollectiveArgumentError(f"all_to_all: tensors of several dtypes on rank {self.rank()}: "
                                          f"{sorted(map(str, dtypes))}.")
        send = torch.cat([view.reshape(-1) for view in in_views])
        receive = torch.empty(sum(tensor.numel() for tensor in outputs), dtype=send.dtype)

        def copy_out() -> None:
            for tensor, chunk in zip(outputs, receive.split([t.numel() for t in outputs]), strict=True):
                _host_view(tensor).copy_(chunk.view(tensor.shape))

        return self._run("all_to_all", lambda: self._gloo.alltoall_base(
            receive, send, [t.numel() for t in outputs], [t.numel() for t in inputs], opts or AllToAllOptions()),
            outputs, (send, receive), after=copy_out)

    # ---- rooted ----
    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: GatherOptions | None = None) -> Work:
        opts = opts or GatherOptions()
        self._check_root("gather", opts.rootRank)
        in_views = self._views("gather", "input", inputs)
        out_views = []
        for outputs in output_lists:
            if outputs:
                self._check_list("gather", "gather_list", outputs)
            out_views.append(self._views("gather", "gather_list", outputs, inputs[0].device if inputs else None))
        flat = [tensor for outputs in output_lists for tensor in outputs]
        return self._run("gather", lambda: self._gloo.gather(out_views, in_views, opts), flat, (in_views, out_views))

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                opts: ScatterOptions | None = None) -> Work:
        opts = opts or ScatterOptions()
        self._check_root("scatter", opts.rootRank)
        out_views = self._views("scatter", "output", outputs)
        in_views = []
        for inputs in input_lists:
            if inputs:
                self._check_list("scatter", "scatter_list", inputs)
            in_views.append(self._views("scatter", "scatter_list", inputs, outputs[0].device if outputs else None))
        return self._run("scatter", lambda: self._gloo.scatter(out_views, in_views, opts), outputs,
                         (out_views, in_views))

    def barrier(self, opts: BarrierOptions | None = None) -> Work:
        opts = opts or BarrierOptions()
        return self._run("barrier", lambda: self._gloo.barrier(opts), [], ())

    # ---- point to point ----
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work:
        self._check_root("send", dst, "destination")  # (gloo would wait for the timeout)
        views = self._views("send", "tensors", tensors)
        return self._run(f"send to rank {dst}", lambda: self._gloo.send(views, dst, tag), tensors, views)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        self._check_root("recv", src, "source")
        views = self._views("recv", "tensors", tensors)
        return self._run(f"recv from rank {src}", lambda: self._gloo.recv(views, src, tag), tensors, views)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        views = self._views("recv", "tensors", tensors)
        return self._run("recv from any rank", lambda: self._gloo.recv_anysource(views, tag), tensors, views)


def _scale_in_place(views: list[torch.Tensor], factor: float | None) -> None:
    """Scales the inputs of an op whose inputs are its outputs (all_reduce, reduce)."""
    if factor is not None:
        for view in views:
            view.mul_(factor)


def _scaled(views: list[torch.Tensor], factor: float | None) -> list[torch.Tensor]:
    """Scaled copies of the inputs of an op whose inputs are not its outputs (reduce_scatter)."""
    return views if factor is None else [view * factor for view in views]


def _copy_options(opts: Any) -> Any:
    """A fresh options object per op of a coalesced call (PREMUL_SUM rewrites the one it gets)."""
    if opts is None:
        return None
    copy = type(opts)()
    for name in ("reduceOp", "timeout", "asyncOp"):
        if hasattr(opts, name):
            setattr(copy, name, getattr(opts, name))
    return copy


def _rank_device() -> str:
    return f"neuron:{torch.neuron.current_device()}"
