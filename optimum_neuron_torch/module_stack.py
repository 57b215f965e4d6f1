"""Which `nn.Module` is running: the stack of module calls, with qualified names, observed through
PyTorch's global module hooks while a block is active (so fallbacks can name their caller)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

Listener = Callable[["ModuleStack"], None]


class ModuleStack:
    """The modules whose forward is running, outermost first, named as in `root.named_modules()`."""

    def __init__(self) -> None:
        self._running: list[str] = []
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()

    @property
    def depth(self) -> int:
        """How many module forwards are running (0 outside any)."""
        return len(self._running)

    @property
    def current(self) -> str | None:
        """The innermost running module's name, or None outside any forward."""
        return self._running[-1] if self._running else None

    def push(self, module: nn.Module) -> None:
        if not self._running and module not in self._names:
            root = type(module).__name__
            for name, child in module.named_modules():
                self._names[child] = f"{root}.{name}" if name else root
        self._running.append(self._names.get(module, type(module).__name__))

    def pop(self) -> None:
        self._running.pop()


@contextlib.contextmanager
def observing_modules(on_enter: Listener, on_exit: Listener) -> Iterator[ModuleStack]:
    """Calls `on_enter` before and `on_exit` after (also when it raises) every module forward in
    the block, with the stack as it is outside, resp. inside, that module. Compiled code is not
    observed: Dynamo traces the hooks away."""
    stack = ModuleStack()

    # A listener may raise (the `error` policy does). The stack stays balanced all the same: PyTorch
    # calls an `always_call` forward hook even when a pre-hook raised, so every enter pushes and
    # every exit pops.
    def enter(module: nn.Module, args: object) -> None:
        if not torch.compiler.is_compiling():
            try:
                on_enter(stack)
            finally:
                stack.push(module)

    def exit(module: nn.Module, args: object, output: object) -> None:
        if not torch.compiler.is_compiling():
            try:
                on_exit(stack)
            finally:
                stack.pop()

    handles = [
        nn.modules.module.register_module_forward_pre_hook(enter),
        nn.modules.module.register_module_forward_hook(exit, always_call=True),
    ]
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()
