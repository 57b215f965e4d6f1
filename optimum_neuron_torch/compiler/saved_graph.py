"""Dynamo's graph kept as data: the product of the backend that AOT precompile saves (see
`precompiled`), compiled by the library's backend on its first call, in this process or the next.

A graph is pickled with `GraphPickler` without Dynamo's fake values (they hold its tracing context,
which does not pickle) and compiled from fake values computed again from the first call's inputs.
"""

from __future__ import annotations

import importlib
import pickle
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.aot_compile_types import SerializableCallable

from ..errors import first_line

# Node metadata kept in a saved graph: Dynamo's fake values hold its tracing context, which does not
# pickle; they are computed again from the call's inputs (see `SavedGraph`).
KEPT_META = ("stack_trace",)
# A scalar Dynamo's graph reads from a tensor (`.item()` of a length it specialized on) cannot be
# computed again from fake values: the value Dynamo saw is kept under this name.
SCALAR_META = "precompiled_scalar"


class GraphNotReplayable(Exception):
    """A saved graph that cannot be compiled from its data (raised on its first call)."""


class SavedGraph(SerializableCallable):
    """Dynamo's graph as data, compiled by the backend named `backend` (`"module:function"` or a
    Dynamo backend's name) on its first call, from the fake values of that call's inputs (with the
    `requires_grad` Dynamo recorded, part of a program's cache key). One path for a graph just
    traced and one loaded; and the backend compiles outside of AOT precompile's capture, whose
    AOTAutograd settings (a bundled cache entry expected back) TorchNeuron's backend does not meet."""

    def __init__(self, graph: bytes, backend: str, requires_grad: list[bool | None]) -> None:
        self.graph, self.backend, self.requires_grad = graph, backend, requires_grad
        self._compiled: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_dynamo(cls, gm: torch.fx.GraphModule, example_inputs: list[Any], backend: str) -> SavedGraph:
        """Dynamo's graph `gm`, to be compiled by `backend`."""
        requires_grad = [value.requires_grad if isinstance(value, torch.Tensor) else None for value in example_inputs]
        return cls(_dumps(gm), backend, requires_grad)

    @classmethod
    def serialize_compile_artifacts(cls, fn: SavedGraph) -> bytes:
        return pickle.dumps({"graph": fn.graph, "backend": fn.backend, "requires_grad": fn.requires_grad})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> SavedGraph:
        return cls(**pickle.loads(data))

    def __call__(self, *args: Any) -> Any:
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    gm, backend = _loads(self.graph), backend_named(self.backend)
                    try:
                        examples = _fake_values(gm, args, self.requires_grad)
                    except Exception as error:  # (e.g. a scalar read in the graph, which Dynamo kept unbacked)
                        raise GraphNotReplayable(f"its graph's values cannot be computed again "
                                                 f"({type(error).__name__}: {first_line(error)})") from error
                    try:
                        self._compiled = backend(gm, examples)
                    except Exception as error:  # (raised as Dynamo raises a backend's error: callers handle that)
                        raise torch._dynamo.exc.BackendCompilerFailed(backend, error, None) from error
        return self._compiled(*args)


def backend_named(name: str) -> Callable[..., Any]:
    from torch._dynamo.backends.registry import lookup_backend

    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function) if function else lookup_backend(name)


def _graph_modules(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    return [module for module in gm.modules() if isinstance(module, torch.fx.GraphModule)]


def _dumps(gm: torch.fx.GraphModule) -> bytes:
    from torch.fx._graph_pickler import GraphPickler, Options

    nodes = [node for module in _graph_modules(gm) for node in module.graph.nodes]
    metas = [node.meta for node in nodes]
    try:
        for node in nodes:
            scalar = node.meta.get("example_value")
            node.meta = {name: value for name, value in node.meta.items() if name in KEPT_META}
            if type(scalar) in (int, float, bool):
                node.meta[SCALAR_META] = scalar
        return GraphPickler.dumps(gm, Options(ops_filter=None))
    finally:
        for node, meta in zip(nodes, metas, strict=True):
            node.meta = meta


def _loads(data: bytes) -> torch.fx.GraphModule:
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    gm = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    gm.recompile()
    return gm


def _fake_values(gm: torch.fx.GraphModule, args: tuple[Any, ...], requires_grad: list[bool | None]) -> list[Any]:
    """Records on each node of `gm` (and of the regions it calls) the fake value Dynamo recorded
    when it traced, computed again from `args`; returns the fake inputs."""
    from torch._subclasses import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode()
    fakes = [mode.from_tensor(value) if isinstance(value, torch.Tensor) else value for value in args]
    for fake, grad in zip(fakes, requires_grad, strict=True):
        if isinstance(fake, torch.Tensor) and grad is not None and fake.requires_grad != grad:
            fake.requires_grad_(grad)

    class Propagation(FakeTensorProp):
        def run_node(self, node: torch.fx.Node) -> Any:  # (a scalar read in the graph: the value Dynamo saw)
            recorded = node.meta.get(SCALAR_META)
            return recorded if recorded is not None else super().run_node(node)

    def propagate(module: torch.fx.GraphModule, inputs: list[Any]) -> None:
        Propagation(module, mode).propagate_dont_convert_inputs(*inputs)
        for node, value in zip(module.graph.find_nodes(op="placeholder"), inputs, strict=True):
            node.meta["val"] = value  # (the inputs themselves: FakeTensorProp records them without grad)
        for node in module.graph.nodes:  # (under Dynamo's name too: AOTAutograd's cache looks for it)
            if "val" in node.meta:
                node.meta["example_value"] = node.meta["val"]

    propagate(gm, fakes)
    done = set()
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        subgraph, identifier, *operands = node.args
        if identifier not in done:
            done.add(identifier)
            propagate(getattr(gm, subgraph.target),
                      [operand.meta["val"] if isinstance(operand, torch.fx.Node) else operand for operand in operands])
    return fakes
