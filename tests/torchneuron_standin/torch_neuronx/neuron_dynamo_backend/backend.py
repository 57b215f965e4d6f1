"""The `neuron` torch.compile backend, simulated: TorchNeuron's contract without its compiler.

Like TorchNeuron's: AOTAutograd with `keep_inference_input_mutations=True`, static shapes only, a warning
for modes other than "default", one `NeuronCompilationMetrics` per graph, and compiled graphs in a NEFF
cache that MegaCache can carry. Unlike it, "compiling" only stores the graph's code as the NEFF (so keys
and hits behave like TorchNeuron's cache) and execution runs the ATen graph eagerly on the device.
`_stats` counts compilations and NEFF cache hits for tests.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch._aot_autograd.logging_utils import get_aot_graph_name
from torch._functorch._aot_autograd.utils import make_boxed_func

from torch_neuronx.neuron_dynamo_backend import _neff_cache
from torch_neuronx.neuron_dynamo_backend import cache_artifact as _cache_artifact  # noqa: F401
from torch_neuronx.neuron_dynamo_backend.metrics import (
    NeuronCompilationMetrics,
    record_compilation,
)

logger = logging.getLogger(__name__)

_stats = {"compiled": 0, "neff_cache_hits": 0}
# Test-only knob: "1" makes every execution of a compiled graph fail on the (simulated) device.
FAIL_EXECUTION_ENV = "TORCH_NEURONX_STANDIN_FAIL_EXECUTION"
_TRUE = ("1", "true", "yes", "on")  # (TorchNeuron's `_getenv_bool`)
_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _is_symbolic(value) -> bool:
    if isinstance(value, torch.SymInt):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(size, torch.SymInt) for size in value.shape)
    return False


def _has_dynamic_shapes(gm: torch.fx.GraphModule, example_inputs) -> bool:
    if any(_is_symbolic(value) for value in example_inputs):
        return True
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value", node.meta.get("val"))
        if _is_symbolic(value):
            return True
    return False


def _graph_key(gm: torch.fx.GraphModule, example_inputs) -> str:
    """The NEFF cache key: the graph's code and its inputs' shapes and dtypes."""
    digest = hashlib.sha256(gm.code.encode())
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            digest.update(f"|{tuple(value.shape)}:{value.dtype}".encode())
        else:
            digest.update(f"|{type(value).__name__}:{value!r}".encode())
    return digest.hexdigest()[:64]


def _has_collectives(gm: torch.fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_function":
            name = getattr(node.target, "__name__", str(node.target))
            if any(collective in name for collective in _COLLECTIVES):
                return True
    return False


def _refuse_what_torchneuron_cannot_lower(gm: torch.fx.GraphModule) -> None:
    """TorchNeuron compiles a graph whole or fails at compile time (`backend.py`,
    `neuron_backend_fx_compiler`: any error of the lowering becomes "Neuron backend NEFF execution setup
    failed"), and the Neuron device has no complex dtype: a graph computing in one fails there."""
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.is_complex():
            raise RuntimeError(f"Neuron backend NEFF execution setup failed with unexpected error: node {node.name} "
                               f"({node.target}) computes in {value.dtype}, which the Neuron device does not have")


def _make_fw_compiler(options: dict):
    def neuron_backend_fx_compiler(gm: torch.fx.GraphModule, example_inputs):
        """Looks the graph up in the NEFF cache, "compiles" it on a miss, and runs it eagerly."""
        start = time.perf_counter_ns()
        _refuse_what_torchneuron_cannot_lower(gm)
        key = _graph_key(gm, example_inputs)
        passes_done = time.perf_counter_ns()
        if _neff_cache.get(key) is None:
            _neff_cache.put(key, gm.code.encode())
            _stats["compiled"] += 1
            compile_us = (time.perf_counter_ns() - passes_done) // 1000
        else:
            _stats["neff_cache_hits"] += 1
            compile_us = 0
        _neff_cache.track(key)

        model_name = options.get("model_name", "model_default")
        aot_name = get_aot_graph_name()
        compile_id = aot_name.split("__", 1)[-1] if "__" in aot_name else aot_name
        record_compilation(
            NeuronCompilationMetrics(
                graph_id=key,
                graph_name=f"{model_name}_{compile_id}",
                model_name=model_name,
                has_collectives=_has_collectives(gm),
                graph_node_count=len(gm.graph.nodes),
                timestamp=time.strftime("%Y%m%d_%H%M%S"),
                torch_neuronx_fx_passes_us=(passes_done - start) // 1000,
                torch_neuronx_lower_us=0,
                torch_neuronx_compile_us=compile_us,
            )
        )
        def execution_wrapper(*inputs):
            """As TorchNeuron's (backend.py `execution_wrapper`): a graph that fails on the device runs
            again eagerly, unless TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION is set (read at each failure)."""
            try:
                if os.environ.get(FAIL_EXECUTION_ENV, "") == "1":
                    raise RuntimeError(f"NRT execution failed: NRT_EXEC_BAD_INPUT (stand-in: {FAIL_EXECUTION_ENV}=1)")
                return gm.forward(*inputs)
            except Exception as e:
                if os.environ.get("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "").lower() in _TRUE:
                    raise e from e
                logger.error(f"Execution failed: {e}")
                logger.warning("Falling back to original GraphModule execution")
                return gm.forward(*inputs)

        return make_boxed_func(execution_wrapper)

    return neuron_backend_fx_compiler


def neuron_backend(gm: torch.fx.GraphModule, example_inputs, *, options=None, mode="default"):
    """`torch.compile(backend="neuron")`: static shapes only; modes other than "default" are ignored."""
    if mode != "default":
        # TorchNeuron warns on the root logger.
        logging.warning(f"Neuron backend does not support mode='{mode}', falling back to default mode.")  # noqa: LOG015
    options = dict(options or {})
    options.setdefault("dynamic", False)
    if _has_dynamic_shapes(gm, example_inputs):
        raise RuntimeError("Dynamic shapes detected in the model, but torch-neuronx requires static shapes")
    if gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        # Torch-MLIR's FxImporter imports no invoke_subgraph (nested_compile_region): TorchNeuron's
        # message, from its dynamo test spec (tests/pytorch_tests/specs/dynamo_spec.json).
        raise RuntimeError("Neuron backend NEFF execution setup failed with unexpected error: Higher-order "
                           "operation 'invoke_subgraph' not implemented in the FxImporter (tried "
                           "'_import_hop_invoke_subgraph')")
    backend = aot_autograd(fw_compiler=_make_fw_compiler(options), keep_inference_input_mutations=True)
    return backend(gm, example_inputs)
