"""One compile per distinct layer: a graph whose repeated layers Dynamo traced as nested compile
regions (`torch.compiler.nested_compile_region`) is compiled a region at a time.

Dynamo traces a function marked with `torch.compiler.nested_compile_region` as a subgraph, called
through the `invoke_subgraph` higher-order op, and gives every call whose traced code is the same
one subgraph (the 30 decoder layers of a model: one subgraph, 30 calls, each with its own weights and
cache tensors as inputs). TorchNeuron's compiler cannot take that op (its FxImporter has no
`invoke_subgraph`, see the TorchNeuron mirror's dynamo test spec), and Inductor, which can, would
still compile the whole graph as one program. So this backend compiles each distinct subgraph once
(Dynamo gives calls of other code or input shapes another subgraph) with the device's own `neuron`
backend, and splits the rest of the graph (embeddings, masks, the final norm and head) into
pieces compiled by that backend too, calling the compiled region where each layer was. The
Neuron compiler then sees one layer instead of all of them: the compile time of a graph falls
roughly by the number of repeated layers, and equal layers are one entry of the compile cache (its
key is the code and the input shapes, not the weights). The cost is one program launch per layer
instead of one per step.

A graph without regions goes to the device's backend whole (split only around the nodes TorchNeuron's
compiler cannot take, see `partition.compile_or_split`). `repeated_layers_as_regions(model)`
marks a model's repeated layers (scoped: the marks go when the block ends); `compile_by_layer` is
`torch.compile` of a function of the model that marks them around each call, what compiled
generation and the server compile their steps with.

Example:
    >>> import torch
    >>> from optimum_neuron_torch.compiler import regions
    >>> layer = torch.nn.Linear(8, 8)
    >>> step = torch.compiler.nested_compile_region(lambda x: torch.relu(layer(x)))
    >>> run = torch.compile(lambda x: step(step(x)), backend=regions.backend, fullgraph=True)
    >>> run(torch.ones(2, 8).to("neuron")).shape  # doctest: +SKIP
    torch.Size([2, 8])
"""

from __future__ import annotations

import contextlib
import functools
import operator
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._dynamo.backends.registry import lookup_backend

from .. import settings
from . import partition
from .precompiled import PrecompiledFunction

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
# The device's own compile backend: TorchNeuron's, or the library's on the reference device.
NEURON_COMPILE_BACKEND = "neuron"

CompileGraph = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]


class CompiledRegion:
    """A region compiled once, called where each of its `invoke_subgraph` calls was."""

    def __init__(self, identifier: str, compiled: Callable[..., Any]) -> None:
        self.identifier = identifier
        self.compiled = compiled
        self.__name__ = f"compiled_region_{identifier}"  # (how the call reads in the parent graph's code)

    def __call__(self, *operands: Any) -> Any:
        return self.compiled(*operands)


def region_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The `invoke_subgraph` calls of `gm`, in graph order."""
    return list(gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH))


def compile_regions(gm: torch.fx.GraphModule, example_inputs: list[Any], compile_graph: CompileGraph
                    ) -> Callable[..., Any]:
    """`gm` compiled by `compile_graph(graph, example_inputs)` a region at a time: each distinct
    region once (Dynamo gives one identifier to the calls whose traced code and input shapes are the
    same), the nodes between regions in pieces; `gm` whole when it calls no region.

    Args:
        gm: a Dynamo graph.
        example_inputs: its example inputs.
        compile_graph: the backend compiling each part (a Dynamo backend's signature).

    Returns:
        The callable running `gm`.
    """
    calls = region_calls(gm)
    if not calls:
        return compile_graph(gm, example_inputs)
    compiled: dict[str, CompiledRegion] = {}
    for node in calls:
        subgraph, identifier, *operands = node.args
        if identifier not in compiled:  # (compiled once: the device's backend may rewrite a graph it compiles)
            examples = [partition.recorded_value(operand) if isinstance(operand, torch.fx.Node) else operand
                        for operand in operands]
            compiled[identifier] = CompiledRegion(identifier, compile_graph(getattr(gm, subgraph.target), examples))
        node.target, node.args = compiled[identifier], tuple(operands)
    for node in list(gm.graph.find_nodes(op="get_attr")):  # (the subgraphs, now compiled)
        if not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    # The outputs of a region are taken where they are used: those items stay with the region.
    apart = {*calls, *(user for node in calls for user in node.users
                       if user.op == "call_function" and user.target is operator.getitem)}
    split = partition.split(gm, {}, compile_graph, apart=apart)
    return split if split is not None else gm


def backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
    """A Dynamo backend: `gm` compiled a region at a time by the device's `neuron` backend (given
    `kwargs`, e.g. `options`), see `compile_regions`, each part split around the nodes TorchNeuron's
    compiler cannot take (`partition.compile_or_split`). The backend of the library's own compiled
    paths, on both backends."""
    device_backend = lookup_backend(NEURON_COMPILE_BACKEND)

    def compile_graph(graph: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        return partition.compile_or_split(graph, inputs, lambda piece, examples: device_backend(piece, examples,
                                                                                                **kwargs))

    return compile_regions(gm, example_inputs, compile_graph)


def compile_by_layer(function: Callable[..., Any], *, whole_because: str | None = None,
                     **options: Any) -> LayerwiseCompiled:
    """`torch.compile(function, **options)` whose repeated layers are compiled once each: the
    compiled function takes the model as its first argument, and each call traces the model's
    repeated layers as regions (see `repeated_layers_as_regions`) for `backend`, which hands them
    to the device's backend. A model whose layers Dynamo cannot trace as regions (T5's layers pass
    their position bias along in a way `invoke_subgraph` does not capture) is compiled whole, with
    one warning (see `LayerwiseCompiled`).

    Args:
        function: what to compile; its first argument is the model (a function, not a bound method,
            so that the compiled function holds no reference to the model).
        whole_because: if given, why to compile whole graphs from the start (no regions).
        options: `torch.compile`'s options (`fullgraph`, `dynamic`, `mode`); `backend`, if given,
            must be the device's own (`"neuron"`).

    Returns:
        The compiled function, called as `function` is.

    Raises:
        ValueError: `backend` names another backend.

    Example:
        >>> step = regions.compile_by_layer(lambda model, ids: model(ids).logits, fullgraph=True)  # doctest: +SKIP
        >>> logits = step(model, ids)  # doctest: +SKIP
    """
    device_backend = options.pop("backend", NEURON_COMPILE_BACKEND)
    if device_backend != NEURON_COMPILE_BACKEND:
        raise ValueError(f"compile_by_layer compiles for the device's compile backend {NEURON_COMPILE_BACKEND!r}, "
                         f"not {device_backend!r}")
    return LayerwiseCompiled(function, options, whole_because)


def reuse_off_reason(whole_because: str | None = None) -> str | None:
    """Why `compile_by_layer` compiles whole graphs from the start, or None: the setting
    `OPTIMUM_NEURON_TORCH_DISABLE_LAYER_REUSE=1`, else the caller's `whole_because`."""
    return f"{settings.DISABLE_LAYER_REUSE_ENV}=1" if settings.layer_reuse_disabled() else whole_because


class LayerwiseCompiled:
    """What `compile_by_layer` returns: `function` compiled a region at a time, or whole when
    `OPTIMUM_NEURON_TORCH_DISABLE_LAYER_REUSE=1`, when the caller says why, or once that failed
    (`whole_graph_reason` says why; from then on every call runs the whole graphs, so that a model
    never has both graph sets compiled for one shape)."""

    def __init__(self, function: Callable[..., Any], options: dict[str, Any], whole_because: str | None = None
                 ) -> None:
        functools.update_wrapper(self, function)
        self.function, self.options = function, options
        self.whole_graph_reason = reuse_off_reason(whole_because)
        self._by_layer = PrecompiledFunction(function, options, backend=f"{__name__}:backend")
        self._whole = self._compiled_whole() if self.whole_graph_reason is not None else None

    def __call__(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self._whole is None:
            try:
                with repeated_layers_as_regions(model):
                    return self._by_layer(model, *args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as error:  # (raised while tracing or compiling: nothing ran)
                cause = getattr(error, "inner_exception", None) or error  # (a backend's own error, not its wrapper)
                reason = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0]}"
                self._whole = self._compiled_whole()
                result = self._whole(model, *args, **kwargs)  # (an error here is the model's own, not the regions')
                self.whole_graph_reason = reason
                warnings.warn(f"{type(model).__name__}'s repeated layers could not be compiled once each ({reason}): "
                              "compiling whole graphs, each holding every layer (on Trainium, a compile time that "
                              "grows with the number of layers).", stacklevel=2)
                return result
        return self._whole(model, *args, **kwargs)

    def saved(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> set[str] | None:
        """The compile-cache entries a call would run, when it would trace and compile nothing, else
        None (see `PrecompiledFunction.saved`); runs nothing."""
        if self._whole is not None:
            return self._whole.saved(model, *args, **kwargs)
        with repeated_layers_as_regions(model):
            return self._by_layer.saved(model, *args, **kwargs)

    def _compiled_whole(self) -> PrecompiledFunction:
        # (by `backend` too: a graph without regions goes to the device's backend whole, split only
        # around what it cannot take, see `partition.compile_or_split`)
        return PrecompiledFunction(self.function, self.options, backend=f"{__name__}:backend")


def repeated_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of `model` that repeat: the members of its `torch.nn.ModuleList`s whose class
    appears more than once in the list (a Transformers model's decoder layers)."""
    layers = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            classes = [type(member) for member in module]
            layers += [member for member in module if classes.count(type(member)) > 1]
    return layers


@contextlib.contextmanager
def repeated_layers_as_regions(model: torch.nn.Module) -> Iterator[list[torch.nn.Module]]:
    """Inside the block, Dynamo traces each repeated layer of `model` (see `repeated_layers`) as a
    nested compile region: the layers of one class share one marked `forward`, so Dynamo gives the
    calls whose traced code is the same one subgraph. The class's own `forward` is not touched
    (marking it would mark every model of that class in the process); each layer gets an instance
    attribute, removed at the end of the block.

    Args:
        model: the model about to be traced.

    Returns:
        The layers marked.

    Example:
        >>> with regions.repeated_layers_as_regions(model):  # doctest: +SKIP
        ...     logits = torch.compile(model, backend=regions.backend, fullgraph=True)(ids).logits
    """
    layers = [layer for layer in repeated_layers(model) if "forward" not in vars(layer)]
    for layer in layers:
        layer.forward = types.MethodType(_marked_forward(type(layer)), layer)
    try:
        yield layers
    finally:
        for layer in layers:
            vars(layer).pop("forward", None)


@functools.cache
def _marked_forward(cls: type) -> Callable[..., Any]:
    """`cls.forward`, wrapped in a new function marked as a nested compile region; one per class,
    so that a graph compiled inside one block passes Dynamo's guards inside the next."""
    forward = cls.forward

    def region(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    region.__name__ = region.__qualname__ = f"{cls.__name__}_region"
    marked = torch.compiler.nested_compile_region(region)
    # Named as the attribute it is set as: Dynamo's guards reach a bound method through its name
    # when they are saved for a warm start (see `precompiled`).
    marked.__name__ = "forward"
    return marked
