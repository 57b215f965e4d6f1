"""The StableHLO lowering check: the graph the backend compiles, lowered with Torch-MLIR to the
StableHLO that TorchNeuron's compiler receives, and kept as text with the compiled graph.

Optional: it runs when the `stablehlo` extra (a pinned torch-mlir) is installed. A graph that does
not lower is reported (TorchNeuron would fail to compile it); it still runs on the reference device.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any

import torch

from ..errors import LoweringError

aten = torch.ops.aten
# The namespaces of the functional collectives (what `torch.distributed._functional_collectives`,
# DTensor and FSDP put in graphs). Torch-MLIR has no lowering for them; TorchNeuron lowers them
# itself, to its own collective instructions.
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")


def _namespaced_name(target: Any) -> str | None:
    """`namespace::op` of an ATen-style op (an overload or its packet), else None."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._opname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def is_collective(node: torch.fx.Node) -> bool:
    """Whether `node` calls a functional collective."""
    name = _namespaced_name(node.target) if node.op == "call_function" else None
    return name is not None and name.partition("::")[0] in COLLECTIVE_NAMESPACES


def collectives(gm: torch.fx.GraphModule) -> list[str]:
    """The functional collectives `gm` calls, each once (`_c10d_functional::all_reduce`, ...)."""
    return sorted({_namespaced_name(node.target) for node in gm.graph.nodes if is_collective(node)})


def available() -> bool:
    """Whether Torch-MLIR is installed."""
    return importlib.util.find_spec("torch_mlir") is not None


def version() -> str | None:
    """The installed Torch-MLIR's version (None without it)."""
    if not available():
        return None
    try:
        return importlib.metadata.version("torch-mlir")
    except importlib.metadata.PackageNotFoundError:  # (a build of its own, e.g. TorchNeuron's fork)
        return "unknown"


def _fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_bias: torch.Tensor | None = None,
                     dropout_p: float = 0.0, is_causal: bool = False, return_debug_mask: bool = False,
                     scale: float | None = None) -> tuple[Any, ...]:
    """The device's fused attention as the CPU flash kernel, which PyTorch decomposes to math ops
    (Torch-MLIR has no lowering for the overrideable op itself)."""
    output, logsumexp = aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_bias, scale=scale
    )
    seed = torch.zeros((), dtype=torch.long, device=query.device)
    return output, logsumexp, None, None, query.shape[2], key.shape[2], seed, seed, None


def _fused_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attn_bias: torch.Tensor | None, grad_input_mask: list[bool], out: torch.Tensor,
                              logsumexp: torch.Tensor, cum_seq_q: Any, cum_seq_k: Any, max_q: int, max_k: int,
                              dropout_p: float, is_causal: bool, philox_seed: Any, philox_offset: Any,
                              scale: float | None = None) -> tuple[Any, ...]:
    """The backward of the device's fused attention (no dropout, as the device selects it) as math
    ops, which Torch-MLIR lowers: the softmax is recomputed, and key and value heads shared by
    several query heads (grouped-query attention) get the sum of their gradients."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    groups = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query @ keys.transpose(-2, -1)) * scale
    if is_causal:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril(scores.shape[-1]
                                                                                               - scores.shape[-2])
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_bias is not None:
        scores = scores.masked_fill(~attn_bias, float("-inf")) if attn_bias.dtype == torch.bool else scores + attn_bias
    probabilities = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    grad_probabilities = grad_out @ values.transpose(-2, -1)
    grad_scores = probabilities * (grad_probabilities - (grad_probabilities * probabilities).sum(-1, keepdim=True))
    grad_query = (grad_scores @ keys) * scale
    grad_keys = (grad_scores.transpose(-2, -1) @ query) * scale
    grad_values = probabilities.transpose(-2, -1) @ grad_out

    def per_shared_head(grad: torch.Tensor) -> torch.Tensor:
        return grad.unflatten(1, (key.shape[1], groups)).sum(2)

    return grad_query, per_shared_head(grad_keys), per_shared_head(grad_values), None


def _slice_backward(grad_output: torch.Tensor, input_sizes: list[int], dim: int, start: int, end: int,
                    step: int) -> torch.Tensor:
    """`slice_backward` as zeros and a `slice_scatter`, its end clamped to the dimension: Torch-MLIR
    runs out of memory on the op with the open end (2**63 - 1) that slicing `x[a:]` records."""
    end = min(end, input_sizes[dim])
    return torch.slice_scatter(grad_output.new_zeros(input_sizes), grad_output, dim, start, end, step)


def lower(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str:
    """The StableHLO text of `gm`: exported to a functional ATen graph (weights stay inputs, never
    constants), with devices made host ones (StableHLO has none), then imported by Torch-MLIR.
    Raises `LoweringError` with Torch-MLIR's diagnostics (which it would print to stderr) when
    Torch-MLIR fails."""
    from torch._decomp import get_decompositions
    from torch._functorch.aot_autograd import aot_export_module
    from torch_mlir.compiler_utils import TorchMlirCompilerError
    from torch_mlir.dialects import torch as torch_dialect
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table
    from torch_mlir.extras.fx_importer import FxImporter
    from torch_mlir.fx import stateless_fx_import
    from torch_mlir.ir import Context

    decompositions = {
        **get_decomposition_table(),
        **get_decompositions([aten._scaled_dot_product_flash_attention_for_cpu]),
        aten._scaled_dot_product_fused_attention_overrideable.default: _fused_attention,
        aten._scaled_dot_product_fused_attention_overrideable_backward.default: _fused_attention_backward,
        aten.slice_backward.default: _slice_backward,
    }
    with torch._guards.tracing(None):
        graph, _ = aot_export_module(gm, example_inputs, trace_joint=False, decompositions=decompositions)
    for node in graph.graph.nodes:
        if "device" in node.kwargs:
            node.kwargs = {**node.kwargs, "device": torch.device("cpu")}
    graph.recompile()
    context = Context()
    torch_dialect.register_dialect(context)
    diagnostics: list[str] = []
    context.attach_diagnostic_handler(lambda diagnostic: diagnostics.append(diagnostic.message) or True)
    try:
        return str(stateless_fx_import(graph, output_type="stablehlo", fx_importer=FxImporter(context=context)))
    except TorchMlirCompilerError as error:
        raise LoweringError(diagnostics[0] if diagnostics else str(error).strip().splitlines()[0]) from error
