"""Partitioning a compiled graph around the nodes TorchNeuron's compiler cannot take: the parts it
can take are compiled (each one a cached graph with its own StableHLO), the rest runs eagerly on
the device between them (through the device's counted fallback path where an op is not native),
instead of the whole graph failing as it does under TorchNeuron's backend, which compiles a graph
whole or not at all. The library's own compiled paths (`regions.backend`: compiled generation, the
server, `check()`) split this way on both backends (`compile_or_split`); the device's `neuron`
backend itself refuses such a graph on both (`refusal`), as TorchNeuron's does.

A node is unsupported when
- TorchNeuron's compiler cannot take it by construction: a complex, sparse or float64 tensor goes
  in or out, or a shape depends on data (nonzero, unique, masked_select...: Dynamo gives such
  values unbacked symbolic sizes, which static-shape graphs cannot have);
- with torch-mlir (the `stablehlo` extra; TorchNeuron's own on Trn): it does not lower to
  StableHLO. The backend lowers the whole graph first; only when that fails is each distinct node
  lowered alone, to find the culprits.
Without torch-mlir only the first rule applies: a graph that would not lower is compiled whole.

The eager op list (`torchneuron_native_ops.txt`) is not the criterion: TorchNeuron's compiler
lowers whatever Torch-MLIR lowers (`pow` in RMSNorm compiles, although no eager kernel exists).

`OPTIMUM_NEURON_TORCH_DISABLE_GRAPH_SPLIT=1` makes the library's paths refuse to split too, as
TorchNeuron 2.33 refuses to run such a graph (`TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION`): they
raise naming the nodes.
"""

from __future__ import annotations

import contextlib
import operator
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.fx.node import _get_qualified_name
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from ..errors import LoweringError, UnsupportedGraphError
from ..settings import DISABLE_GRAPH_SPLIT_ENV, graph_split_disabled
from . import stablehlo

PIECE_PREFIX = "compiled_piece_"


class FallbackNode(NamedTuple):
    """A node that runs eagerly between compiled pieces, and why TorchNeuron's compiler cannot take it."""

    node: str
    op: str
    reason: str


@dataclass
class PartitionReport:
    """How one graph was split: the compiled pieces, and the nodes that run eagerly between them."""

    compiled_pieces: int
    fallback_nodes: list[FallbackNode] = field(default_factory=list)

    @property
    def summary(self) -> str:
        """One line naming each op once, with its reason."""
        ops = list(dict.fromkeys(f"{node.op} ({node.reason})" for node in self.fallback_nodes))
        count = len(self.fallback_nodes)
        return (f"graph split into {self.compiled_pieces} compiled piece{'s' * (self.compiled_pieces != 1)} around "
                f"{count} op{'s' * (count != 1)} TorchNeuron's compiler cannot take: {', '.join(ops)}")


_recorders: list[list[PartitionReport]] = []


@contextlib.contextmanager
def recording_partitions() -> Iterator[list[PartitionReport]]:
    """Collects the reports of the graphs split inside the block."""
    reports: list[PartitionReport] = []
    _recorders.append(reports)
    try:
        yield reports
    finally:
        _recorders.remove(reports)


def recorded_value(node: torch.fx.Node) -> Any:
    """The fake value Dynamo (`example_value`) or AOTAutograd (`val`) recorded for `node`."""
    return node.meta.get("example_value", node.meta.get("val"))


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a (possibly nested) value."""
    return [item for item in torch.utils._pytree.tree_leaves(value) if isinstance(item, torch.Tensor)]


def _op_name(node: torch.fx.Node) -> str:
    """What `node` calls, as a user finds it in PyTorch (`torch._C._special.special_zeta`, `Tensor.abs`)."""
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return _get_qualified_name(node.target) if callable(node.target) else str(node.target)


def _computes(node: torch.fx.Node) -> bool:
    """Whether `node` calls something (the nodes a partition can hold)."""
    return node.op in ("call_function", "call_method", "call_module")


def _construction_reason(node: torch.fx.Node) -> str | None:
    """Why TorchNeuron's compiler cannot take `node` whatever it lowers to, or None."""
    inputs = [recorded_value(arg) for arg in node.all_input_nodes]
    output = recorded_value(node)
    for tensor in _tensors([output, inputs]):
        if tensor.is_complex():
            return "complex dtype"
        if tensor.dtype == torch.float64:
            return "float64 dtype"
        if tensor.layout != torch.strided:
            return f"{str(tensor.layout).removeprefix('torch.')} layout"
    if node.target is torch.ops.higher_order.invoke_subgraph:  # (compile with `regions.backend` instead)
        return "nested compile region (TorchNeuron's FxImporter has no invoke_subgraph)"
    if free_unbacked_symbols(output):
        return "data-dependent output shape"
    if free_unbacked_symbols(inputs):
        return "input of data-dependent shape"
    return None


def unsupported_by_construction(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """The nodes TorchNeuron's compiler cannot take by construction, with the reason for each: a
    scan of the recorded fake values, cheap enough for every graph."""
    reasons = {node: _construction_reason(node) for node in gm.graph.nodes if _computes(node)}
    return {node: reason for node, reason in reasons.items() if reason is not None}


def _lowering_failure(error: LoweringError) -> str:
    """A short reason from Torch-MLIR's diagnostic: the op it could not legalize, else the diagnostic."""
    op = re.search(r'name = "torch\.(\w+\.[\w.]+)"', str(error))
    return (f"no StableHLO lowering for {op.group(1)}" if op
            else f"no StableHLO lowering (Torch-MLIR: {str(error)[:160]})")


_lowering_verdicts: dict[str, str | None] = {}


def _alone(node: torch.fx.Node) -> tuple[torch.fx.GraphModule, list[torch.Tensor]] | None:
    """`node` as a one-node graph with its inputs' fake values as example inputs (no memory, same
    devices), or None when its inputs or outputs are not all tensors (such a node follows the
    pieces around it)."""
    inputs = node.all_input_nodes
    if node.op == "call_module" or not all(isinstance(recorded_value(arg), torch.Tensor) for arg in inputs):
        return None
    output = recorded_value(node)
    several = isinstance(output, (tuple, list))
    outputs = list(output) if several else [output]
    if not outputs or not all(isinstance(item, torch.Tensor) for item in outputs):
        return None
    graph = torch.fx.Graph()
    placeholders = {arg: graph.placeholder(arg.name) for arg in inputs}
    copy = graph.node_copy(node, placeholders.__getitem__)
    graph.output(tuple(graph.call_function(operator.getitem, (copy, i)) for i in range(len(outputs)))
                 if several else (copy,))
    return torch.fx.GraphModule({}, graph), [recorded_value(arg) for arg in inputs]


def _lowering_reason(node: torch.fx.Node) -> str | None:
    """Why `node` alone does not lower to StableHLO, or None; memoized per op, arguments and input
    shapes, dtypes and devices."""
    def describe(arg: torch.fx.Node) -> str:
        value = recorded_value(arg)
        if isinstance(value, torch.Tensor):
            return f"{tuple(value.shape)}:{value.dtype}:{value.device}"
        return type(value).__name__

    if stablehlo.is_collective(node):
        return None  # TorchNeuron lowers collectives itself, not through Torch-MLIR
    signature = f"{node.op} {_op_name(node)} {torch.fx.map_arg((node.args, node.kwargs), describe)!r}"
    if signature not in _lowering_verdicts:
        alone = _alone(node)
        _lowering_verdicts[signature] = None
        try:
            if alone is not None:
                stablehlo.lower(*alone)
        except LoweringError as error:  # Torch-MLIR's verdict about the op
            _lowering_verdicts[signature] = _lowering_failure(error)
        except Exception:  # the check itself failed on this node: that says nothing about the op
            pass
    return _lowering_verdicts[signature]


def failing_to_lower(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """The nodes of a graph that did not lower which do not lower alone either, with the reason for
    each (needs torch-mlir)."""
    reasons = {node: _lowering_reason(node) for node in gm.graph.nodes if _computes(node)}
    return {node: reason for node, reason in reasons.items() if reason is not None}


class _Supported(OperatorSupportBase):
    """The operator support the fx partitioner asks: every computing node not left out."""

    def __init__(self, left_out: set[torch.fx.Node]) -> None:
        self.left_out = left_out

    def is_node_supported(self, submodules: Any, node: torch.fx.Node) -> bool:
        return _computes(node) and node not in self.left_out


def _item_sources(node: torch.fx.Node) -> list[torch.fx.Node]:
    """For an item-taking node (`operator.getitem`), its inputs whose every user takes an item of them."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return []
    return [source for source in node.all_input_nodes
            if all(user.op == "call_function" and user.target is operator.getitem for user in source.users)]


def _index_by_tensors_as_calls(gm: torch.fx.GraphModule) -> None:
    """Makes each tensor indexed by another tensor (`weights[expert_ids]`, `hidden[:, last]`) a method
    call, `tensor.__getitem__(index)`, instead of `operator.getitem(tensor, index)` (the same op; a
    method of a tensor, which AOTAutograd's cache accepts as it does `operator.getitem`). torch.fx's
    partitioner takes every `operator.getitem` for an item of a tuple output and moves it to the
    partition of the node it is taken from, once per pass until nothing moves: an item taken from two
    such nodes (the indexed tensor and the index, each used for indexing only) moves back and forth
    without end."""
    changed = False
    for node in gm.graph.nodes:
        if len(_item_sources(node)) > 1 and isinstance(recorded_value(node.args[0]), torch.Tensor):
            node.op, node.target, changed = "call_method", "__getitem__", True
    if changed:
        gm.recompile()


def _listed(unsupported: dict[torch.fx.Node, str]) -> str:
    return "; ".join(f"node {node.name} ({_op_name(node)}): {reason}" for node, reason in unsupported.items())


def refusal(unsupported: dict[torch.fx.Node, str]) -> UnsupportedGraphError:
    """The error of the device's `neuron` backend for a graph holding `unsupported` nodes: TorchNeuron
    compiles a graph whole or fails (a lowering error is "Neuron backend NEFF execution setup
    failed"), so the reference device fails there too, naming the nodes."""
    return UnsupportedGraphError(
        f"Neuron backend: TorchNeuron's compiler cannot take {len(unsupported)} node(s) of this graph "
        f"({_listed(unsupported)}), and its backend compiles a graph whole or not at all. Compile with "
        "optimum_neuron_torch.compiler.regions.backend, which splits the graph around them (as the library's "
        "compiled generation does), keep them out of the compiled code, or rewrite or patch the model so that "
        "they lower."
    )


def _cannot_split(listed: str, count: int, why: str) -> UnsupportedGraphError:
    return UnsupportedGraphError(
        f"This graph holds {count} node(s) TorchNeuron's compiler cannot take ({listed}), and it cannot be split "
        f"around them: {why}. Rewrite or patch the model so that these ops lower."
    )


def _order_reads_after_writes(gm: torch.fx.GraphModule) -> list[str]:
    """Makes every read of a tensor that follows an in-place write into it (`keys.index_copy_(...)`
    of a static cache) read the write's result instead, which is the same tensor: the partitioner
    orders nodes by their inputs only, and would otherwise be free to put the read first. Returns
    the names of in-place writes that return nothing to read (`operator.setitem`) and are followed
    by a read of their tensor: those cannot be ordered this way."""
    unordered = []
    position = {node: index for index, node in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        target = node.args[0] if node.op in ("call_function", "call_method") and node.args else None
        if not isinstance(target, torch.fx.Node):
            continue
        later = [user for user in target.users if position[user] > position[node]]
        if node.op == "call_function" and node.target is operator.setitem:
            if later:
                unordered.append(node.name)
        elif _writes_in_place(node):
            for user in later:
                user.replace_input_with(target, node)
    gm.recompile()
    return unordered


def _writes_in_place(node: torch.fx.Node) -> bool:
    """Whether `node` writes into its first argument in place and returns it (`Tensor.index_copy_`,
    `aten.add_.Tensor`...)."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("__")
    if isinstance(node.target, torch._ops.OpOverload):
        arguments = node.target._schema.arguments
        return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
    return False


class CompiledPiece(torch.nn.Module):
    """A compiled supported part of a split graph, called in its parent graph like the submodule it replaces."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *inputs: Any) -> Any:
        return self.compiled(*inputs)


def split(gm: torch.fx.GraphModule, unsupported: dict[torch.fx.Node, str],
          compile_piece: Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]],
          apart: set[torch.fx.Node] = frozenset()) -> torch.fx.GraphModule | None:
    """`gm` with each supported part fused into a submodule compiled by `compile_piece(piece,
    example_inputs)` and the unsupported nodes left to run eagerly, as are the nodes `apart`
    (which run compiled already: the calls of compiled regions, see `regions`). None when there is
    nothing to split at, or only nodes `apart` and no part to compile; `gm` itself, run eagerly, when
    every computing node is unsupported. Raises `UnsupportedGraphError` when splitting around
    unsupported nodes is disabled."""
    fallback = [FallbackNode(node.name, _op_name(node), reason) for node, reason in unsupported.items()]
    if not fallback and not apart:
        return None
    if fallback and graph_split_disabled():
        listed = _listed(unsupported)
        raise UnsupportedGraphError(
            f"This graph holds {len(fallback)} node(s) TorchNeuron's compiler cannot take, "
            f"and {DISABLE_GRAPH_SPLIT_ENV}=1 "
            f"refuses to split it: {listed}. Rewrite or patch the model around these ops, keep them out of the "
            f"compiled region, or unset {DISABLE_GRAPH_SPLIT_ENV} to run them eagerly between compiled pieces."
        )
    listed = _listed(unsupported) or "none"
    _index_by_tensors_as_calls(gm)
    shared_items = [node.name for node in gm.graph.nodes if len(_item_sources(node)) > 1]
    if shared_items:
        raise _cannot_split(listed, len(fallback), f"node(s) {', '.join(shared_items)} index one tensor by another, "
                                                   "which the torch.fx partitioner cannot place")
    unordered = _order_reads_after_writes(gm)
    if unordered:
        raise _cannot_split(listed, len(fallback), f"node(s) {', '.join(unordered)} write into a tensor in place "
                                                   "without returning it, so a split could read the tensor before "
                                                   "the write")
    partitioner = CapabilityBasedPartitioner(gm, _Supported({*unsupported, *apart}), allows_single_node_partition=True)
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    partitions = sorted(partitioner.propose_partitions(), key=lambda partition: min(map(order.get, partition.nodes)))
    if not partitions and not fallback:
        return None
    parent = gm if not partitions else fuse_by_partitions(  # (no part to compile: the graph runs eagerly)
        gm, [partition.nodes for partition in partitions], prefix=PIECE_PREFIX,
        always_return_tuple=True)  # compiled graphs return their outputs as a list
    for node in parent.graph.find_nodes(op="call_module"):
        if node.target.startswith(PIECE_PREFIX):
            piece = getattr(parent, node.target)
            examples = [recorded_value(arg) for arg in node.args]
            setattr(parent, node.target, CompiledPiece(compile_piece(piece, examples)))
    if not fallback:
        return parent
    report = PartitionReport(len(partitions), fallback)
    warnings.warn(f"{report.summary}. They run eagerly on the device; "
                  f"{DISABLE_GRAPH_SPLIT_ENV}=1 makes this an error.",
                  stacklevel=2)
    for reports in _recorders:
        reports.append(report)
    return parent


def compile_or_split(gm: torch.fx.GraphModule, example_inputs: list[Any],
                     compile_graph: Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]
                     ) -> Callable[..., Any]:
    """`gm` compiled by `compile_graph` (the device's `neuron` backend), split around the nodes
    TorchNeuron's compiler cannot take when there are any: what the library's own compiled paths
    (`regions.backend`) do on both backends.

    TorchNeuron's backend compiles a graph whole or fails (a graph Torch-MLIR does not lower fails
    at compile time: `neuron_dynamo_backend/backend.py`, "Neuron backend NEFF execution setup
    failed"); it never splits. So a graph holding nodes unsupported by construction is split before
    the backend sees it, and a graph the backend refuses is split around the nodes that do not lower
    alone (with torch-mlir: the `stablehlo` extra, or TorchNeuron's own), each piece compiled by the
    backend. The reference device's backend refuses such a graph as TorchNeuron's does (see
    `dynamo_backend`), so this runs the same way on both.

    Args:
        gm: a Dynamo graph.
        example_inputs: its example inputs.
        compile_graph: the backend compiling the graph or each piece (a Dynamo backend's signature).

    Returns:
        The callable running `gm`.

    Raises:
        UnsupportedGraphError: splitting is disabled (`OPTIMUM_NEURON_TORCH_DISABLE_GRAPH_SPLIT=1`)
            and the graph holds such nodes.
        Exception: the backend's own error, when it refuses a graph with no node to split around.
    """
    unsupported = unsupported_by_construction(gm)
    if not unsupported:
        try:
            return compile_graph(gm, example_inputs)
        except Exception:
            unsupported = failing_to_lower(gm) if stablehlo.available() else {}
            if not unsupported:
                raise
    return split(gm, unsupported, compile_graph)
