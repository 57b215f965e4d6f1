"""Which `nn.Module` is running: the stack of module calls, with qualified names, observed through
hooks on the modules of the models asked for, while they are needed (so fallbacks can name their
caller); never through PyTorch's global module hooks, which every module of the process would run."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

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
    them), removed by `close()` once no open observer needs them. Compiled code is not observed:
    Dynamo traces the hooks away.

    The hooks are module-level functions that ask the open observers (so a model pickles with
    `torch.save` while observed, and a copy of it, which carries them, runs them as no-ops), one
    pair per module whatever the number of observers.

    Args:
        on_enter (`Callable[[ModuleStack], None]`): called before each forward.
        on_exit (`Callable[[ModuleStack], None]`): called after each forward, also when it raised.
    """

    def __init__(self, on_enter: Listener, on_exit: Listener) -> None:
        self.stack = ModuleStack()
        self._on_enter, self._on_exit = on_enter, on_exit
        self.modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        _OPEN.append(self)

    def observe(self, model: nn.Module) -> None:
        """Observes every module of `model` (those it already observes are left as they are)."""
        for module in model.modules():
            self.modules.add(module)
            if module not in _HANDLES:
                _HANDLES[module] = (module.register_forward_pre_hook(_enter_module),
                                    module.register_forward_hook(_exit_module, always_call=True))

    def close(self) -> None:
        """Stops observing; removes the hooks of the modules no open observer observes."""
        if self in _OPEN:
            _OPEN.remove(self)
        for module in list(self.modules):
            if not any(module in observer.modules for observer in _OPEN):
                for handle in _HANDLES.pop(module, ()):
                    handle.remove()
        self.modules = weakref.WeakSet()

    # A listener may raise (the `error` policy does). The stack stays balanced all the same: PyTorch
    # calls an `always_call` forward hook even when a pre-hook raised, so every enter pushes and
    # every exit pops.
    def _enter(self, module: nn.Module) -> None:
        try:
            self._on_enter(self.stack)
        finally:
            self.stack.push(module)

    def _exit(self, module: nn.Module) -> None:
        try:
            self._on_exit(self.stack)
        finally:
            self.stack.pop()


_OPEN: list[ModuleObserver] = []  # the observers not closed
_HANDLES: weakref.WeakKeyDictionary[nn.Module, tuple[RemovableHandle, RemovableHandle]] = weakref.WeakKeyDictionary()


def _each_observer(module: nn.Module, step: Callable[[ModuleObserver, nn.Module], None]) -> None:
    """`step` for each open observer of `module`, all of them even when one raises (then raised)."""
    if torch.compiler.is_compiling():
        return
    raised = None
    for observer in list(_OPEN):
        if module in observer.modules:
            try:
                step(observer, module)
            except BaseException as error:  # (each observer's stack stays balanced; the first error raises)
                raised = raised or error
    if raised is not None:
        raise raised


def _enter_module(module: nn.Module, args: object) -> None:
    _each_observer(module, ModuleObserver._enter)


def _exit_module(module: nn.Module, args: object, output: object) -> None:
    _each_observer(module, ModuleObserver._exit)


@contextlib.contextmanager
def observing_modules(model: nn.Module, on_enter: Listener, on_exit: Listener) -> Iterator[ModuleStack]:
    """A `ModuleObserver` of `model` inside the block (see there); yields its stack."""
    observer = ModuleObserver(on_enter, on_exit)
    observer.observe(model)
    try:
        yield observer.stack
    finally:
        observer.close()
