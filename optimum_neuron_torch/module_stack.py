"""Which `nn.Module` is running: the stack of module calls, with qualified names, observed through
hooks on the modules of the models asked for, while they are needed (so fallbacks can name their
caller); never through PyTorch's global module hooks, which every module of the process would run."""

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


class ModuleObserver:
    """Calls `on_enter` before and `on_exit` after (also when it raises) every forward of the modules
    of the models it observes (`observe`), with the stack as it is outside, resp. inside, that
    module: hooks on each of their modules, none global (other modules of the process run without
    them), all removed by `close()`. Compiled code is not observed: Dynamo traces the hooks away.

    Args:
        on_enter (`Callable[[ModuleStack], None]`): called before each forward.
        on_exit (`Callable[[ModuleStack], None]`): called after each forward, also when it raised.
    """

    def __init__(self, on_enter: Listener, on_exit: Listener) -> None:
        self.stack = ModuleStack()
        self._on_enter, self._on_exit = on_enter, on_exit
        self._hooked: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # (a module shared by two models: once)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def observe(self, model: nn.Module) -> None:
        """Observes every module of `model` (those it already observes are left as they are)."""
        for module in model.modules():
            if module not in self._hooked:
                self._hooked.add(module)
                self._handles += [module.register_forward_pre_hook(self._enter),
                                  module.register_forward_hook(self._exit, always_call=True)]

    def close(self) -> None:
        """Removes every hook: the models run as before."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked = weakref.WeakSet()

    # A listener may raise (the `error` policy does). The stack stays balanced all the same: PyTorch
    # calls an `always_call` forward hook even when a pre-hook raised, so every enter pushes and
    # every exit pops.
    def _enter(self, module: nn.Module, args: object) -> None:
        if not torch.compiler.is_compiling():
            try:
                self._on_enter(self.stack)
            finally:
                self.stack.push(module)

    def _exit(self, module: nn.Module, args: object, output: object) -> None:
        if not torch.compiler.is_compiling():
            try:
                self._on_exit(self.stack)
            finally:
                self.stack.pop()


@contextlib.contextmanager
def observing_modules(model: nn.Module, on_enter: Listener, on_exit: Listener) -> Iterator[ModuleStack]:
    """A `ModuleObserver` of `model` inside the block (see there); yields its stack."""
    observer = ModuleObserver(on_enter, on_exit)
    observer.observe(model)
    try:
        yield observer.stack
    finally:
        observer.close()
