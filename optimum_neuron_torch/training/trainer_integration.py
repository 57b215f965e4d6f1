"""What lets a plain Transformers `Trainer` train on the `neuron` device, on both backends.

Transformers and accelerate carry `neuron` branches (device choice, the `neuron` c10d backend,
`torch.compile`'s `neuron` backend, bf16), but switch them on only when the module `torch_neuronx`
(TorchNeuron) can be found: on the reference device a plain `Trainer` would silently train on the
CPU. And no release saves the `neuron` RNG state in its checkpoints, so a resumed run with dropout
would not repeat the uninterrupted one. Neither library has a hook for either, so this module makes
two named, reversible adjustments (`ADJUSTMENTS`), applied once per process by
`NeuronAutoModel*.from_pretrained` (never at import) and undone by `disable()`:

- `neuron_detection` (reference device only): Transformers' `is_torch_neuron_available` and
  accelerate's `is_neuron_available` answer for the reference device as they do for TorchNeuron.
- `neuron_rng_checkpoint` (both backends): `Trainer` checkpoints also hold the `neuron` RNG state
  (`rng_state_neuron.pth`, `rng_state_neuron_{rank}.pth` in distributed runs), restored on resume.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable

import torch

from ..device.selection import activate

logger = logging.getLogger(__name__)

ADJUSTMENTS = {
    "neuron_detection": "Transformers' is_torch_neuron_available and accelerate's is_neuron_available are true on "
                        "the reference device (they look for the module torch_neuronx), so that TrainingArguments "
                        "picks `neuron`, accepts bf16, and accelerate runs DDP and FSDP over the `neuron` backend.",
    "neuron_rng_checkpoint": "Trainer checkpoints also save and restore the `neuron` RNG state "
                             "(rng_state_neuron[_{rank}].pth), which Transformers does not save for this device.",
}
RNG_FILE = "rng_state_neuron"
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
    if activate().name == "reference":
        _undo.append(_answer_neuron_detection())
        _active_names.append("neuron_detection")
    _undo.append(_save_neuron_rng_in_checkpoints())
    _active_names.append("neuron_rng_checkpoint")
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


def _rng_file(trainer, folder: str) -> str:
    suffix = f"_{trainer.args.process_index}" if trainer.args.world_size > 1 else ""
    return os.path.join(folder, f"{RNG_FILE}{suffix}.pth")


def _save_neuron_rng_in_checkpoints() -> Callable[[], None]:
    """Wraps `Trainer._save_rng_state` and `Trainer._load_rng_state` (the methods that write and
    read the other devices' RNG states) to do the same for `neuron`."""
    from transformers import Trainer

    save, load = Trainer._save_rng_state, Trainer._load_rng_state

    @functools.wraps(save)
    def save_rng_state(self, output_dir: str) -> None:
        save(self, output_dir)
        if self.args.device.type == "neuron":
            torch.save({"neuron": torch.neuron.get_rng_state()}, _rng_file(self, output_dir))

    @functools.wraps(load)
    def load_rng_state(self, checkpoint: str | None) -> None:
        load(self, checkpoint)
        if checkpoint is None or self.args.device.type != "neuron":
            return
        path = _rng_file(self, checkpoint)
        if not os.path.isfile(path):
            logger.warning("%s not found: the neuron RNG state is not restored, so random ops (dropout) will not "
                           "repeat the interrupted run's (was the checkpoint saved at another world size, or "
                           "without optimum_neuron_torch?)", path)
            return
        torch.neuron.set_rng_state(torch.load(path, weights_only=True)["neuron"])

    Trainer._save_rng_state, Trainer._load_rng_state = save_rng_state, load_rng_state

    def undo() -> None:
        Trainer._save_rng_state, Trainer._load_rng_state = save, load

    return undo
