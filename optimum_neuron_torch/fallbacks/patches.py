"""Scoped, reversible model patches: rewrites of constructs TorchNeuron cannot run (complex tensors,
data-dependent shapes, float64, sparse tensors) into equivalents it can, applied to one model instance.

A patch never touches a Transformers class or function: it replaces a module's `forward` on the
instance (with Transformers' own implementation where one exists) or flips an attribute on the
instance. Each `apply` returns its undo; `model.neuron_patches` lists what a model carries.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
from transformers.integrations import moe
from transformers.modeling_rope_utils import dynamic_rope_update

Undo = Callable[[], None]


@dataclass(frozen=True)
class ModelPatch:
    """A named rewrite: `applies(model)` says whether this model needs it, `apply(model)` does it
    on that instance and returns the undo."""

    name: str
    description: str  # one line: what it replaces and why
    architectures: tuple[str, ...]  # Transformers model types it is known to apply to
    applies: Callable[[nn.Module], bool]
    apply: Callable[[nn.Module], Undo]


PATCHES: dict[str, ModelPatch] = {}


def register_patch(patch: ModelPatch) -> ModelPatch:
    """Adds a patch to the registry that `apply_patches` draws from."""
    if patch.name in PATCHES:
        raise ValueError(f"a model patch named {patch.name!r} is already registered.")
    PATCHES[patch.name] = patch
    return patch


def patches_for(model: nn.Module) -> list[ModelPatch]:
    """The registered patches this model needs (those whose detector fires)."""
    return [patch for patch in PATCHES.values() if patch.applies(model)]


def apply_patches(model: nn.Module, names: Iterable[str] | None = None) -> list[str]:
    """Applies to this model instance the patches it needs, among `names` if given (default: all
    registered), adds them to `model.neuron_patches` and keeps their undos; returns those applied."""
    candidates = list(PATCHES.values()) if names is None else [_known(name) for name in names]
    model.neuron_patches = getattr(model, "neuron_patches", [])
    model._neuron_patch_undos = getattr(model, "_neuron_patch_undos", [])
    new = [patch for patch in candidates if patch.name not in model.neuron_patches and patch.applies(model)]
    for patch in new:
        model._neuron_patch_undos.append(patch.apply(model))
        model.neuron_patches.append(patch.name)
    return [patch.name for patch in new]


def revert_patches(model: nn.Module) -> None:
    """Undoes every patch on this model, newest first, leaving `model.neuron_patches` empty."""
    _revert_latest(model, len(getattr(model, "neuron_patches", [])))


@contextlib.contextmanager
def patched(model: nn.Module, names: Iterable[str] | None = None) -> Iterator[list[str]]:
    """Applies the patches the model needs (among `names`) for the block, and reverts those on exit."""
    applied = apply_patches(model, names)
    try:
        yield applied
    finally:
        _revert_latest(model, len(applied))


def _known(name: str) -> ModelPatch:
    if name not in PATCHES:
        raise ValueError(f"unknown model patch {name!r}; known patches: {', '.join(sorted(PATCHES))}.")
    return PATCHES[name]


def _revert_latest(model: nn.Module, count: int) -> None:
    """Undoes the `count` most recently applied patches, newest first (undos assume that order)."""
    for _ in range(count):
        model._neuron_patch_undos.pop()()
        model.neuron_patches.pop()


# -- Reading and replacing module code -------------------------------------------------------------


@functools.cache
def _names_used(cls: type) -> frozenset[str]:
    """The global and attribute names read by the class's forward and by the methods of the class
    and functions of its module that it calls, read from the bytecode (no source needed)."""
    names: set[str] = set()
    pending, seen = [cls.forward], set()
    while pending:
        function = inspect.unwrap(pending.pop())
        if not isinstance(function, types.FunctionType) or function in seen:
            continue
        seen.add(function)
        for name in _code_names(function.__code__):
            names.add(name)
            for callee in (getattr(cls, name, None), function.__globals__.get(name)):
                if isinstance(callee, types.FunctionType) and callee.__module__ == cls.__module__:
                    pending.append(callee)
    return frozenset(names)


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):  # nested functions, lambdas, comprehensions
            yield from _code_names(constant)


def _replace_forward(module: nn.Module, forward: Callable) -> Undo:
    """Makes `forward` this instance's forward; the undo restores exactly what was there."""
    previous = module.__dict__.get("forward")
    module.forward = forward

    def undo() -> None:
        if previous is None:
            del module.forward
        else:
            module.forward = previous

    return undo


def _with_globals(function: Callable, replacements: dict[str, Callable]) -> types.FunctionType:
    """A copy of `function` in which the global names in `replacements` resolve to them; decorators
    are kept (each wrapper is copied with its closure pointing at the copied inner function)."""
    inner = getattr(function, "__wrapped__", None)
    if inner is None:
        # Without `__name__`, Dynamo guards on this namespace itself instead of the module it names.
        namespace = {key: value for key, value in function.__globals__.items() if key != "__name__"}
        namespace.update(replacements)
        closure = function.__closure__
    else:
        inner_copy = _with_globals(inner, replacements)
        namespace, cells = function.__globals__, function.__closure__ or ()
        if not any(cell.cell_contents is inner for cell in cells):
            raise TypeError(f"cannot reach the function wrapped by {function.__qualname__}: no closure holds it.")
        closure = tuple(types.CellType(inner_copy) if cell.cell_contents is inner else cell for cell in cells)
    copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__, closure)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__module__ = function.__module__
    copy.__dict__.update(function.__dict__)
    if inner is not None:
        copy.__wrapped__ = inner_copy
    return copy


def _undo_all(undos: list[Undo]) -> Undo:
    """One undo running `undos` in reverse order."""

    def undo() -> None:
        for step in reversed(undos):
            step()

    return undo


# -- complex_rope: complex rotary embeddings in real arithmetic ------------------------------------

# Modeling modules whose text RoPE is complex (the rotary module returns `torch.polar(1, angles)`,
# `apply_rotary_emb` multiplies `view_as_complex(q, k)` by it), with the axis at which their
# `apply_rotary_emb` inserts the heads dimension into the frequencies.
_COMPLEX_ROPE_HEADS_AXIS = {
    "transformers.models.llama4.modeling_llama4": 2,  # q, k: (batch, seq, heads, head_dim)
    "transformers.models.deepseek_v2.modeling_deepseek_v2": 1,  # q, k: (batch, heads, seq, head_dim)
}


@dynamic_rope_update
def _real_rotary_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The rotary module's forward with `torch.polar(1, angles)` kept real: (cos, sin) in a last axis of 2."""
    angles = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    return torch.stack((angles.cos(), angles.sin()), dim=-1) * self.attention_scaling


def _rotate(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """`view_as_real(view_as_complex(x) * cis)` with `cis` given as (cos, sin) pairs, in float32."""
    real, imag = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
    cos, sin = cis.unbind(-1)
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2)


def _real_apply_rotary_emb(heads_axis: int) -> Callable:
    """The real twin of a modeling module's complex `apply_rotary_emb`."""

    def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cis = freqs_cis.unsqueeze(heads_axis).to(xq.device)
        return _rotate(xq, cis).type_as(xq), _rotate(xk, cis).type_as(xk)

    return apply_rotary_emb


def _complex_rope_sites(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The rotary modules computing `torch.polar` and the attention modules calling the complex
    `apply_rotary_emb`, in the modeling modules this patch knows."""
    rotaries, attentions = [], []
    for module in model.modules():
        cls = type(module)
        if cls.__module__ in _COMPLEX_ROPE_HEADS_AXIS:
            names = _names_used(cls)
            if "polar" in names and hasattr(module, "inv_freq"):
                rotaries.append(module)
            elif "apply_rotary_emb" in names:
                attentions.append(module)
    return rotaries, attentions


def _needs_real_rope(model: nn.Module) -> bool:
    rotaries, attentions = _complex_rope_sites(model)
    return bool(rotaries and attentions)


def _make_rope_real(model: nn.Module) -> Undo:
    rotaries, attentions = _complex_rope_sites(model)
    undos = [_replace_forward(module, types.MethodType(_real_rotary_forward, module)) for module in rotaries]
    for module in attentions:
        twin = _real_apply_rotary_emb(_COMPLEX_ROPE_HEADS_AXIS[type(module).__module__])
        forward = _with_globals(type(module).forward, {"apply_rotary_emb": twin})
        undos.append(_replace_forward(module, types.MethodType(forward, module)))
    return _undo_all(undos)


register_patch(ModelPatch(
    name="complex_rope",
    description="Rotary embeddings computed with torch.polar/view_as_complex rewritten as real cos/sin "
                "arithmetic: TorchNeuron has no complex dtypes.",
    architectures=("llama4_text", "llama4", "deepseek_v2"),
    applies=_needs_real_rope,
    apply=_make_rope_real,
))


# -- static_moe_experts: MoE experts without data-dependent shapes --------------------------------

STATIC_EXPERTS = "batched_mm"


def _switchable_experts(model: nn.Module) -> list[nn.Module]:
    """Expert modules whose forward Transformers dispatches on `config._experts_implementation`."""
    return [module for module in model.modules() if _defined_in(type(module).forward, moe.__file__)]


def _defined_in(function: Callable, filename: str) -> bool:
    """Whether `function`'s own code (not what it wraps) comes from `filename`."""
    code = getattr(function, "__code__", None)
    return code is not None and code.co_filename == filename


def _use_static_experts(model: nn.Module) -> Undo:
    """Binds Transformers' own static implementation to each experts module of this instance (the
    config's switch is left alone: models built from one config object share it)."""
    static_forward = moe.ALL_EXPERTS_FUNCTIONS[STATIC_EXPERTS]
    return _undo_all([
        _replace_forward(module, types.MethodType(static_forward, module)) for module in _switchable_experts(model)
    ])


register_patch(ModelPatch(
    name="static_moe_experts",
    description=f"MoE experts run Transformers' {STATIC_EXPERTS!r} experts implementation (each token through "
                "its top-k experts as one gather + bmm) instead of the nonzero/where routing loop or grouped_mm: "
                "TorchNeuron needs static shapes.",
    # The detector finds every experts module built with Transformers' @use_experts_implementation (67 model
    # types in Transformers 5.24); these are the best known.
    architectures=("mixtral", "phimoe", "qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "granitemoe", "deepseek_v2",
                   "deepseek_v3", "glm4_moe", "minimax", "gpt_oss"),
    applies=lambda model: bool(_switchable_experts(model)),
    apply=_use_static_experts,
))


# -- float64_to_float32: float64 narrowed to float32 -----------------------------------------------


class _Float64AsFloat32(TorchFunctionMode):
    """Runs torch functions with every float64 dtype argument, and `Tensor.double`, made float32."""

    def __torch_function__(self, func, tensor_types, args=(), kwargs=None):
        if func is torch.Tensor.double:
            func = torch.Tensor.float
        args, kwargs = tree_map(lambda value: torch.float32 if value is torch.float64 else value, (args, kwargs or {}))
        return func(*args, **kwargs)


def _float64_modules(model: nn.Module) -> list[nn.Module]:
    """Modules whose forward (or what it calls in its modeling module) names float64."""
    return [module for module in model.modules() if {"float64", "double"} & _names_used(type(module))]


def _in_float32(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def forward_in_float32(*args, **kwargs):
        with _Float64AsFloat32():
            return forward(*args, **kwargs)

    return forward_in_float32


def _narrow_float64(model: nn.Module) -> Undo:
    modules = _float64_modules(model)
    warnings.warn(
        f"{type(model).__name__}: float64 in {', '.join(sorted({type(m).__name__ for m in modules}))} is computed "
        "in float32 (TorchNeuron has no float64): results agree to float32 precision.",
        stacklevel=3,
    )
    return _undo_all([_replace_forward(module, _in_float32(module.forward)) for module in modules])


register_patch(ModelPatch(
    name="float64_to_float32",
    description="float64 dtypes requested inside a module's forward become float32 (TorchNeuron has no float64); "
                "note: those values then carry float32 precision.",
    architectures=("aimv2", "rt_detr", "rt_detr_v2", "d_fine", "deimv2", "pp_doclayout_v2", "pp_doclayout_v3",
                   "pp_doclayout_v4", "musicflamingo", "udop"),
    applies=lambda model: bool(_float64_modules(model)),
    apply=_narrow_float64,
))


# -- dense_embeddings: sparse embeddings densified -------------------------------------------------


def _sparse_embeddings(model: nn.Module) -> list[nn.Embedding | nn.EmbeddingBag]:
    return [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]


def _densify_embeddings(model: nn.Module) -> Undo:
    modules = _sparse_embeddings(model)
    for module in modules:
        module.sparse = False

    def undo() -> None:
        for module in modules:
            module.sparse = True

    return undo


register_patch(ModelPatch(
    name="dense_embeddings",
    description="Embeddings built with sparse=True get dense gradients (same forward, same gradient values): "
                "TorchNeuron has no sparse tensors.",
    architectures=(),  # no Transformers 5.24 architecture builds sparse embeddings; custom models do
    applies=lambda model: bool(_sparse_embeddings(model)),
    apply=_densify_embeddings,
))
