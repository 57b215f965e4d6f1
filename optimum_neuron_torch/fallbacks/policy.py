"""The fallback policy: what happens when an op has no native kernel on the `neuron` device.

- `warn` (default): the op runs on the CPU; one warning per op, in TorchNeuron's words.
- `error`: the first fallback raises `NotImplementedError` naming the op, the module of a watched
  model that called it (see below) and the setting.
- `silent`: the op runs on the CPU, counted only.

One policy holds for the process (`OPTIMUM_NEURON_TORCH_FALLBACK` sets it at start);
`fallback_policy(mode)` changes it inside a block. The reference device applies it per call, before
the op runs. TorchNeuron's fallback never reports itself and records each op name once, so the
library reads TorchNeuron's tracker (`get_fallback_ops()`) and acts after the fact, when the op has
already run on the CPU:
- `warn` by default: once per op, after each call of a watched model (a forward hook of that model;
  no wait for queued work: an op still queued is reported after a later call), so no model call
  waits; `fallback_ops()` lists everything. A policy set explicitly (`OPTIMUM_NEURON_TORCH_FALLBACK=warn`,
  `set_fallback_policy("warn")`) observes the modules of the watched models: at the start and end of
  each outermost module call, waiting for queued work;
- `error`: entering `error` clears TorchNeuron's tracking (ops seen earlier count again); the tracker
  is read whenever a module of a watched model starts or ends, and a fallback raises there, naming
  the module that ran it (the module that was running when the op ran: the one ending, or the one
  calling a submodule); what no watched module saw raises when a `fallback_policy("error")` block
  ends. TorchNeuron's eager re-run of a compiled graph that fails on the device is turned off
  (`TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1` while the policy is `error`): the failure raises.

The watched models are those the library loaded (`NeuronAutoModel*.from_pretrained`) and those passed
to `watch(model)`: on TorchNeuron, a fallback in another model is told when a watched model's next call
starts or, under `error`, when the `fallback_policy("error")` block ends (or never, under a policy set
for the process with no watched model running). Nothing else of the process is observed: no global
module hook, ever; the hooks on a watched model's modules are there while a policy needs them
(`error`, which on the reference device they only name the caller for, or `warn` set explicitly on
TorchNeuron) and removed when it ends.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from collections.abc import Iterator

import torch

from ..device import backend_info, clear_op_tracking, fallback_ops
from ..module_stack import ModuleObserver, ModuleStack
from ..settings import FALLBACK_ENV, fallback_mode_is_set, replace_disable_fallback_execution, requested_fallback_mode

FALLBACK_MESSAGE = "fell back to CPU"
# The models whose fallbacks the policy tells about (see the module's docstring), and the policies
# (one per process, more in tests) whose observers hook the modules of each.
_watched: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_policies: weakref.WeakSet[_Policy] = weakref.WeakSet()


def _applied_per_op() -> bool:
    """Whether the device applies the policy to each op call itself (the reference device)."""
    return backend_info().applies_policy_per_op


class _Policy:
    """The process's policy, and the module observer that names callers while one is needed."""

    def __init__(self) -> None:
        self._mode = ""  # none yet: entering the first one is a change
        self.explicit = False  # set by the user (environment or call), not the default
        self._observer: ModuleObserver | None = None
        self._reported: set[str] = set()
        self._user_execution_setting: str | None | bool = False  # (False: not replaced)
        self._forks_watched = False
        _policies.add(self)
        self.set(requested_fallback_mode(), explicit=fallback_mode_is_set())

    @property
    def mode(self) -> str:
        return backend_info().fallback_mode()

    def set(self, mode: str, explicit: bool = True) -> None:
        backend_info().set_fallback_mode(mode)  # validates it; the reference device applies it to every op call
        if mode == "error" and self._mode != "error" and not _applied_per_op():
            clear_op_tracking()  # TorchNeuron records an op once: one seen before must raise now
        if not _applied_per_op():
            self._fail_fast(mode == "error")
        self._mode, self.explicit = mode, explicit
        # The reference device needs the observer only to name the caller of a refused op;
        # TorchNeuron needs it to notice fallbacks in each module of the watched models (by default,
        # a hook after each of their calls does).
        needed = mode == "error" or (mode == "warn" and explicit and not _applied_per_op())
        if needed and self._observer is None:
            if not self._forks_watched:  # (once, at the first observer: importing the library registers nothing)
                # A child forked from this process cannot use TorchNeuron's runtime: its module calls (a
                # DataLoader worker's transforms) must not read the device's tracker.
                os.register_at_fork(after_in_child=self._stop_observing)
                self._forks_watched = True
            self._observer = ModuleObserver(self._before_module, self._after_module)
            for model in list(_watched):
                self._observer.observe(model)
            self._reported |= set(fallback_ops())
        elif not needed:
            self._stop_observing()

    @property
    def observing(self) -> bool:
        return self._observer is not None

    def _stop_observing(self) -> None:
        if self._observer is not None:
            self._observer.close()
            self._observer = None

    def _fail_fast(self, on: bool) -> None:
        """TorchNeuron runs a compiled graph that failed on the device again, eagerly, unless
        `TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION` is set (read at each failure): on under `error`,
        the user's own value back after."""
        if on and self._user_execution_setting is False:
            self._user_execution_setting = replace_disable_fallback_execution("1")
        elif not on and self._user_execution_setting is not False:
            replace_disable_fallback_execution(self._user_execution_setting)
            self._user_execution_setting = False

    def _before_module(self, stack: ModuleStack) -> None:
        if _applied_per_op():
            return
        if self._mode == "error":
            self._refuse_fallbacks(stack.current)
        elif stack.depth == 0:  # `warn`: what fell back before a model call ran outside any module
            self._warn_new_fallbacks(None)

    def _after_module(self, stack: ModuleStack) -> None:
        if _applied_per_op():
            _name_caller(stack.current)
        elif self._mode == "error":
            self._refuse_fallbacks(stack.current)
        elif stack.depth == 1:  # `warn`: once per outermost forward, so one wait per model call
            self._warn_new_fallbacks(stack.current)

    def _refuse_fallbacks(self, module: str | None) -> None:
        """TorchNeuron, `error`: raises for ops that fell back since the last check (then forgets them,
        so that the next module is judged on its own ops)."""
        ops = fallback_ops()
        if ops:
            clear_op_tracking()
            where = f"module '{module}'" if module else "code outside any module (or in a compiled function)"
            raise NotImplementedError(
                f"Operator '{ops[0]}' {FALLBACK_MESSAGE} in {where}"
                + (f" (also {', '.join(ops[1:])})" if len(ops) > 1 else "")
                + f", and {FALLBACK_ENV}=error forbids fallbacks. On TorchNeuron the op has already run on the CPU "
                "when this is raised (at the start or end of the module that ran it)."
            )

    def _warn_new_fallbacks(self, module: str | None, wait: bool = True) -> None:
        """TorchNeuron, `warn`: one warning per op that entered its fallback tracker."""
        new = [op for op in fallback_ops(wait=wait) if op not in self._reported]
        self._reported.update(new)
        for op in new:
            where = f"during a call of '{module}'" if module else "outside any module"
            warnings.warn(f"Operator '{op}' {FALLBACK_MESSAGE} ({where}); see optimum_neuron_torch.fallback_ops().",
                          stacklevel=2)


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


def watch(model: torch.nn.Module) -> None:
    """Puts `model` under the fallback policy's eye, as the models the library loads are (see the
    module's docstring): on TorchNeuron under the default `warn` policy, the ops that fell back to the
    CPU for the first time are told after each call of `model` (a forward hook of `model`; no call
    waits for the device); under `error` (and `warn` set explicitly on TorchNeuron), the fallback is
    named with the module of `model` that ran it. Other models are not observed.

    Args:
        model (`torch.nn.Module`): a model of your own on the `neuron` device (those from
            `NeuronAutoModel*.from_pretrained` are watched already). Watching it twice does nothing.

    Example:
        >>> from optimum_neuron_torch.fallbacks import watch
        >>> watch(my_model)
        >>> with optimum_neuron_torch.fallback_policy("error"):
        ...     my_model(inputs)  # NotImplementedError: ... Called from module 'MyModel.head'.
    """
    if model in _watched:
        return
    _watched.add(model)
    for policy in list(_policies):
        if policy._observer is not None:
            policy._observer.observe(model)
    if not _applied_per_op():
        model.register_forward_hook(_after_model_call)


def _after_model_call(module: torch.nn.Module, args: object, output: object) -> None:
    # (a module-level function: a model saved whole with torch.save still pickles; it stands down while an
    # observer tells of the fallbacks module by module)
    observed = any(policy.observing for policy in list(_policies))
    if _policy.mode == "warn" and not observed and not torch.compiler.is_compiling():
        _policy._warn_new_fallbacks(type(module).__name__, wait=False)


def get_fallback_policy() -> str:
    """The fallback policy in force.

    Returns:
        `warn`, `error` or `silent`.

    Example:
        >>> optimum_neuron_torch.get_fallback_policy()
        'warn'
    """
    return _policy.mode


def set_fallback_policy(mode: str) -> None:
    """Sets the fallback policy for the process (see this module's docstring for what each does).

    Args:
        mode: `warn`, `error` or `silent`.

    Raises:
        ConfigurationError: any other mode.

    Example:
        >>> optimum_neuron_torch.set_fallback_policy("error")  # every fallback now raises
    """
    _policy.set(mode)


@contextlib.contextmanager
def fallback_policy(mode: str) -> Iterator[None]:
    """Sets the fallback policy inside the block and restores the previous one afterwards.

    Args:
        mode: `warn`, `error` or `silent`.

    Raises:
        ConfigurationError: any other mode (before the block runs).

    Example:
        >>> with optimum_neuron_torch.fallback_policy("error"):
        ...     model(**inputs)  # raises NotImplementedError naming the first op that falls back
    """
    previous, explicit = get_fallback_policy(), _policy.explicit
    set_fallback_policy(mode)
    try:
        yield
        if mode == "error" and not _applied_per_op():
            _policy._refuse_fallbacks(None)  # (TorchNeuron: what no module's end saw, outside any or compiled)
    finally:
        _policy.set(previous, explicit)
