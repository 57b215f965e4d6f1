"""The patch registry and the machinery that applies and reverts patches on one model instance, plus
the helpers the patches share for reading a module's code and replacing its forward."""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import ConfigurationError

Undo = Callable[[], None]


@dataclass(frozen=True)
class ModelPatch:
    """A named rewrite of a construct TorchNeuron cannot run, applied to one model instance.

    Args:
        name (`str`):
            The name `apply_patches`, `patched` and `from_pretrained(patches=[...])` know it by.
        description (`str`):
            One line: what it replaces and why.
        architectures (`tuple[str, ...]`):
            Transformers model types it is known to apply to (informative: `applies` decides).
        applies (`Callable[[nn.Module], bool]`):
            Whether this model needs the patch.
        apply (`Callable[[nn.Module], Callable[[], None]]`):
            Patches that model instance and returns the function that undoes it.

    Example:

    ```python
    >>> from torch import nn
    >>> from optimum_neuron_torch.patches import ModelPatch, register_patch

    >>> def no_dropout(model):
    ...     dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    ...     probabilities = [m.p for m in dropouts]
    ...     for m in dropouts:
    ...         m.p = 0.0
    ...     def undo():
    ...         for m, p in zip(dropouts, probabilities):
    ...             m.p = p
    ...     return undo

    >>> register_patch(ModelPatch(
    ...     name="no_dropout", description="Dropout disabled.", architectures=(),
    ...     applies=lambda model: any(isinstance(m, nn.Dropout) for m in model.modules()), apply=no_dropout,
    ... ))
    ```
    """

    name: str
    description: str  # one line: what it replaces and why
    architectures: tuple[str, ...]  # Transformers model types it is known to apply to
    applies: Callable[[nn.Module], bool]
    apply: Callable[[nn.Module], Undo]


PATCHES: dict[str, ModelPatch] = {}


def register_patch(patch: ModelPatch) -> ModelPatch:
    """Adds a patch to the registry (`PATCHES`) that `apply_patches` draws from.

    Args:
        patch (`ModelPatch`):
            The patch to register; its name must be new.

    Returns:
        `ModelPatch`: `patch`, so that the call can wrap its definition.

    Raises:
        [`~optimum_neuron_torch.errors.ConfigurationError`]:
            If a patch of that name is already registered.

    Example:

    ```python
    >>> from optimum_neuron_torch.patches import PATCHES, register_patch
    >>> register_patch(PATCHES["complex_rope"])
    Traceback (most recent call last):
    ...
    optimum_neuron_torch.errors.ConfigurationError: a model patch named 'complex_rope' is already registered.
    ```
    """
    if patch.name in PATCHES:
        raise ConfigurationError(f"a model patch named {patch.name!r} is already registered.")
    PATCHES[patch.name] = patch
    return patch


def patches_for(model: nn.Module) -> list[ModelPatch]:
    """The registered patches this model needs (those whose `applies` says so).

    Args:
        model (`torch.nn.Module`):
            The model to examine; it is not changed.

    Returns:
        `list[ModelPatch]`: the patches it needs, in registration order.

    Example:

    ```python
    >>> from optimum_neuron_torch import NeuronAutoModelForCausalLM
    >>> from optimum_neuron_torch.patches import patches_for
    >>> model = NeuronAutoModelForCausalLM.from_pretrained("path/to/llama4", patches=False)
    >>> [patch.name for patch in patches_for(model)]
    ['complex_rope']
    ```
    """
    return [patch for patch in PATCHES.values() if patch.applies(model)]


def apply_patches(model: nn.Module, names: Iterable[str] | None = None) -> list[str]:
    """Applies to this model instance the patches it needs, among `names` if given, lists them on
    `model.neuron_patches` and keeps their undos for `revert_patches`. A patch the model already
    carries is not applied twice.

    Args:
        model (`torch.nn.Module`):
            The model to patch, in place (no Transformers class or function is changed).
        names (`Iterable[str]`, *optional*):
            The patches to consider; defaults to every registered patch.

    Returns:
        `list[str]`: the names of the patches applied by this call.

    Raises:
        [`~optimum_neuron_torch.errors.ConfigurationError`]:
            If `names` holds a name that is not a registered patch.

    Example:

    ```python
    >>> from optimum_neuron_torch.patches import apply_patches
    >>> apply_patches(model)  # `NeuronAutoModel*.from_pretrained` does this by default
    ['complex_rope']
    >>> model.neuron_patches
    ['complex_rope']
    ```
    """
    candidates = list(PATCHES.values()) if names is None else [_known(name) for name in names]
    model.neuron_patches = getattr(model, "neuron_patches", [])
    model._neuron_patch_undos = getattr(model, "_neuron_patch_undos", [])
    new = [patch for patch in candidates if patch.name not in model.neuron_patches and patch.applies(model)]
    for patch in new:
        model._neuron_patch_undos.append(patch.apply(model))
        model.neuron_patches.append(patch.name)
    return [patch.name for patch in new]


def revert_patches(model: nn.Module) -> None:
    """Undoes every patch on this model, newest first, leaving `model.neuron_patches` empty.

    Args:
        model (`torch.nn.Module`):
            A model patched by `apply_patches` (or `from_pretrained`); a model without patches is left as is.

    Example:

    ```python
    >>> from optimum_neuron_torch.patches import revert_patches
    >>> revert_patches(model)
    >>> model.neuron_patches
    []
    ```
    """
    _revert_latest(model, len(getattr(model, "neuron_patches", [])))


@contextlib.contextmanager
def patched(model: nn.Module, names: Iterable[str] | None = None) -> Iterator[list[str]]:
    """A context manager applying the patches the model needs (among `names`) for the block, and
    reverting those it applied on exit (also when the block raises).

    Args:
        model (`torch.nn.Module`):
            The model to patch for the block.
        names (`Iterable[str]`, *optional*):
            The patches to consider; defaults to every registered patch.

    Returns:
        The context manager; `as` gives the names of the patches applied on entry (`list[str]`).

    Raises:
        [`~optimum_neuron_torch.errors.ConfigurationError`]:
            If `names` holds a name that is not a registered patch.

    Example:

    ```python
    >>> from optimum_neuron_torch.patches import patched
    >>> with patched(model, ["complex_rope"]) as applied:
    ...     logits = model(input_ids).logits
    >>> applied
    ['complex_rope']
    ```
    """
    applied = apply_patches(model, names)
    try:
        yield applied
    finally:
        _revert_latest(model, len(applied))


def _known(name: str) -> ModelPatch:
    if name not in PATCHES:
        raise ConfigurationError(f"unknown model patch {name!r}; known patches: {', '.join(sorted(PATCHES))}.")
    return PATCHES[name]


def _revert_latest(model: nn.Module, count: int) -> None:
    """Undoes the `count` most recently applied patches, newest first (undos assume that order)."""
    for _ in range(count):
        model._neuron_patch_undos.pop()()
        model.neuron_patches.pop()


# -- Reading and replacing module code (shared by the patches) --------------------------------------


@functools.cache
def code_reached(cls: type) -> tuple[types.CodeType, ...]:
    """The code of the class's forward and of the methods of the class and functions of its module
    that it calls, nested functions included, read from the bytecode (no source needed)."""
    codes: list[types.CodeType] = []
    pending, seen = [cls.forward], set()
    while pending:
        function = inspect.unwrap(pending.pop())
        if not isinstance(function, types.FunctionType) or function in seen:
            continue
        seen.add(function)
        function_codes = list(_nested_codes(function.__code__))
        codes.extend(function_codes)
        for name in {name for code in function_codes for name in code.co_names}:
            for found in (getattr(cls, name, None), function.__globals__.get(name)):
                for callee in _functions_called_by(found):
                    if callee.__module__ == cls.__module__:
                        pending.append(callee)
    return tuple(codes)


def _functions_called_by(value: Any) -> list[types.FunctionType]:
    """`value` if it is a function; for a function the `kernels` package turned into a module (with it
    installed, Transformers >= 5.25 does so to the functions it may swap for a Hub kernel, such as
    the gated delta rule), the functions its forward closes over, the original among them."""
    if isinstance(value, types.FunctionType):
        return [value]
    if isinstance(value, nn.Module):
        cells = getattr(type(value).forward, "__closure__", None) or ()
        return [cell.cell_contents for cell in cells if isinstance(cell.cell_contents, types.FunctionType)]
    return []


@functools.cache
def names_used(cls: type) -> frozenset[str]:
    """The global and attribute names read by the code `code_reached(cls)` finds."""
    return frozenset(name for code in code_reached(cls) for name in code.co_names)


def _nested_codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):  # nested functions, lambdas, comprehensions
            yield from _nested_codes(constant)


def replace_forward(module: nn.Module, forward: Callable) -> Undo:
    """Makes `forward` this instance's forward; the undo restores exactly what was there."""
    previous = module.__dict__.get("forward")
    module.forward = forward

    def undo() -> None:
        if previous is None:
            del module.forward
        else:
            module.forward = previous

    return undo


def forwards_under_mode(modules: Iterable[nn.Module], mode: Callable[[], TorchFunctionMode]) -> Undo:
    """Makes each module's forward run inside a fresh `mode()` (a `TorchFunctionMode` that rewrites
    some torch calls, which Dynamo traces through); the undo restores the forwards."""

    def under_mode(forward: Callable) -> Callable:
        @functools.wraps(forward)
        def forward_under_mode(*args, **kwargs):
            with mode():
                return forward(*args, **kwargs)

        return forward_under_mode

    return undo_all([replace_forward(module, under_mode(module.forward)) for module in modules])


def with_globals(function: Callable, replacements: dict[str, Callable]) -> types.FunctionType:
    """A copy of `function` in which the global names in `replacements` resolve to them; decorators
    are kept (each wrapper is copied with its closure pointing at the copied inner function)."""
    inner = getattr(function, "__wrapped__", None)
    if inner is None:
        # Without `__name__`, Dynamo guards on this namespace itself instead of the module it names.
        namespace = {key: value for key, value in function.__globals__.items() if key != "__name__"}
        namespace.update(replacements)
        closure = function.__closure__
    else:
        inner_copy = with_globals(inner, replacements)
        namespace, cells = function.__globals__, function.__closure__ or ()
        if not any(cell.cell_contents is inner for cell in cells):
            # A plain TypeError, not a NeuronTorchError: an internal invariant (a patch met a decorator
            # it was not written for), a bug in this library rather than anything a user can fix.
            raise TypeError(f"cannot reach the function wrapped by {function.__qualname__}: no closure holds it.")
        closure = tuple(types.CellType(inner_copy) if cell.cell_contents is inner else cell for cell in cells)
    copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__, closure)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__module__ = function.__module__
    copy.__dict__.update(function.__dict__)
    if inner is not None:
        copy.__wrapped__ = inner_copy
    return copy


def undo_all(undos: list[Undo]) -> Undo:
    """One undo running `undos` in reverse order."""

    def undo() -> None:
        for step in reversed(undos):
            step()

    return undo
