"""The fallback policy: what happens when an op has no native kernel on the `neuron` device.

- `warn` (default): the op runs on the CPU; one warning per op, in TorchNeuron's words.
- `error`: the first fallback raises `NotImplementedError` naming the op, the module that called
  it and the setting.
- `silent`: the op runs on the CPU, counted only.

One policy holds for the process (`OPTIMUM_NEURON_TORCH_FALLBACK` sets it at start);
`fallback_policy(mode)` changes it inside a block. The reference device applies it per call. On
TorchNeuron, whose fallback never reports itself, the library reads TorchNeuron's tracker
(`get_fallback_ops()`) after every module call and warns or raises itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from ..device import backend_info, fallback_ops
from ..device.reference.settings import FALLBACK_ENV, FALLBACK_MODES
from ..errors import ConfigurationError
from .modules import ModuleStack, observing_modules

FALLBACK_MESSAGE = "fell back to CPU"


@dataclass(frozen=True)
class FallbackStats:
    """Calls of one op on the fallback path and the seconds they took (None where the backend
    does not count them: TorchNeuron records op names only)."""

    calls: int | None
    seconds: float | None


def _on_reference() -> bool:
    return backend_info().name == "reference"


def fallback_stats() -> dict[str, FallbackStats]:
    """{op: stats} for every op that fell back since start or the last `clear_op_tracking()`."""
    if _on_reference():
        from ..device import reference

        return {op: FallbackStats(calls, seconds) for op, (calls, seconds) in reference.fallback_stats().items()}
    return {op: FallbackStats(None, None) for op in fallback_ops()}


class _Policy:
    """The process's policy, and the module observer that names callers while one is needed."""

    def __init__(self) -> None:
        self._mode = os.environ.get(FALLBACK_ENV, "warn").strip().lower()
        self._observer: contextlib.ExitStack | None = None
        self._reported: set[str] = set()
        self.set(self.mode)

    @property
    def mode(self) -> str:
        if _on_reference():
            from ..device import reference

            return reference.fallback_mode()
        return self._mode

    def set(self, mode: str) -> None:
        if mode not in FALLBACK_MODES:
            raise ConfigurationError(f"unknown fallback policy {mode!r}: use one of {', '.join(FALLBACK_MODES)}.")
        if _on_reference():
            from ..device import reference

            reference.set_fallback_mode(mode)
        self._mode = mode
        # The reference device needs the observer only to name the caller of a refused op;
        # TorchNeuron needs it to notice fallbacks at all.
        needed = mode == "error" or (mode == "warn" and not _on_reference())
        if needed and self._observer is None:
            self._observer = contextlib.ExitStack()
            self._observer.enter_context(observing_modules(_ignore, self._after_module))
            self._reported = set(fallback_ops())
        elif not needed and self._observer is not None:
            self._observer.close()
            self._observer = None

    def _after_module(self, stack: ModuleStack) -> None:
        if _on_reference():
            _name_caller(stack.current)
        else:
            self._report_new_fallbacks(stack.current)

    def _report_new_fallbacks(self, module: str | None) -> None:
        """TorchNeuron: warns about, or refuses, ops that entered its fallback tracker."""
        new = [op for op in fallback_ops() if op not in self._reported]
        self._reported.update(new)
        for op in new:
            message = f"Operator '{op}' {FALLBACK_MESSAGE} (called from module '{module}')"
            if self.mode == "error":
                raise NotImplementedError(f"{message}, and {FALLBACK_ENV}=error forbids fallbacks.")
            warnings.warn(f"{message}; see optimum_neuron_torch.fallback_ops().", stacklevel=2)


def _ignore(stack: ModuleStack) -> None:
    """Nothing to do when a module starts."""


def _name_caller(module: str | None) -> None:
    """Adds the innermost module's name to a refused-fallback error on its way out of it."""
    error = sys.exc_info()[1]
    if (
        isinstance(error, NotImplementedError)
        and error.args
        and FALLBACK_MESSAGE in str(error.args[0])
        and not getattr(error, "neuron_module", None)
    ):
        error.neuron_module = module
        error.args = (f"{error.args[0]} Called from module '{module}'.", *error.args[1:])


_policy = _Policy()


def get_fallback_policy() -> str:
    """The active policy: `warn`, `error` or `silent`."""
    return _policy.mode


def set_fallback_policy(mode: str) -> None:
    """Sets the policy for the process."""
    _policy.set(mode)


@contextlib.contextmanager
def fallback_policy(mode: str) -> Iterator[None]:
    """Sets the policy inside the block and restores the previous one afterwards."""
    previous = get_fallback_policy()
    set_fallback_policy(mode)
    try:
        yield
    finally:
        set_fallback_policy(previous)
