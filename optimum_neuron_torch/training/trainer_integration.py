"""What lets a plain Transformers `Trainer` train on the `neuron` device, on both backends.

Transformers and accelerate carry `neuron` branches (device choice, the `neuron` c10d backend,
`torch.compile`'s `neuron` backend, bf16), but switch them on only when the module `torch_neuronx`
(TorchNeuron) can be found: on the reference device a plain `Trainer` would silently train on the
CPU. Neither library has a hook for it, so this module makes one named, reversible adjustment
(`ADJUSTMENTS`), applied once per process by `NeuronAutoModel*.from_pretrained` (never at import) and
undone by `disable()`:

- `neuron_detection` (reference device only): Transformers' `is_torch_neuron_available` and
  accelerate's `is_neuron_available` answer for the reference device as they do for TorchNeuron.

Checkpoints need nothing more: on `neuron` random ops and dropout draw from the CPU generator (as
TorchNeuron's do), whose state `Trainer` saves and restores, so a resumed run repeats the
uninterrupted one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ..device.selection import activate

ADJUSTMENTS = {
    "neuron_detection": "Transformers' is_torch_neuron_available and accelerate's is_neuron_available are true on "
                        "the reference device (they look for the module torch_neuronx), so that TrainingArguments "
                        "picks `neuron`, accepts bf16, and accelerate runs DDP and FSDP over the `neuron` backend.",
}
# Where Transformers and accelerate ask whether TorchNeuron is there: (module, function name).
_DETECTION = (
    ("transformers.utils.import_utils", "is_torch_neuron_available"),
    ("accelerate.utils.imports", "is_neuron_available"),
)
# Answers cached from the original functions, cleared when the functions change.
_CACHED_ANSWERS = (("transformers.utils.import_utils", "is_torch_bf16_gpu_available"),)

_undo: list[Callable[[], None]] = []
_active_names: list[str] = []


def active() -> list[str]:
    """The names of the adjustments in force in this process (see `ADJUSTMENTS`)."""
    return list(_active_names)


def enable() -> list[str]:
    """Applies the adjustments this backend needs, once per process.

    Returns:
        `list[str]`: the names of the adjustments in force (see `ADJUSTMENTS`).
    """
    if _active_names:
        return active()
    if not activate().detected_by_transformers:
        _undo.append(_answer_neuron_detection())
        _active_names.append("neuron_detection")
    return active()


def disable() -> None:
    """Undoes every adjustment `enable` made: Transformers and accelerate are as they were."""
    while _undo:
        _undo.pop()()
    _active_names.clear()


def _reference_neuron_available(check_device: bool = False) -> bool:
    """Transformers' and accelerate's question, answered for the reference device."""
    return torch.neuron.is_available()


def _answer_neuron_detection() -> Callable[[], None]:
    """Replaces the detection functions in every loaded module that holds them (they are imported
    by name into several modules), and clears the answers cached from the originals."""
    import accelerate.utils.imports  # noqa: F401  (loaded so that the modules importing from them are too)
    import transformers.training_args  # noqa: F401

    originals = [getattr(sys.modules[module], name) for module, name in _DETECTION]
    replaced: list[tuple[object, str, object]] = []
    for module in list(sys.modules.values()):
        for name in {name for _, name in _DETECTION}:
            if getattr(module, name, None) in originals:
                replaced.append((module, name, getattr(module, name)))
                setattr(module, name, _reference_neuron_available)
    _clear_cached_answers()

    def undo() -> None:
        for module, name, original in replaced:
            setattr(module, name, original)
        _clear_cached_answers()

    return undo


def _clear_cached_answers() -> None:
    for module, name in _CACHED_ANSWERS:
        getattr(sys.modules[module], name).cache_clear()
