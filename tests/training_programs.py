"""One Trainer run, the same on the CPU, on `neuron`, and under torchrun (DDP, FSDP2), so that
tests/test_training.py can compare them step by step.

`python tests/training_programs.py OUT.json MODEL_FOLDER [key=value ...]` runs `train()` with those
options (each rank of a torchrun job; rank 0 writes OUT.json): per-step losses, where the parameters
were while training, and how they were sharded.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import accelerate
import torch
import transformers
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

import optimum_neuron_torch as ont

SEQUENCE = 16
EXAMPLES = 96


def dataset(lengths: list[int] | None = None, seed: int = 0) -> list[dict[str, list[int]]]:
    """Token-id examples (ids 4..127): `EXAMPLES` of `SEQUENCE` tokens, or one per length given."""
    generator = torch.Generator().manual_seed(seed)
    lengths = lengths or [SEQUENCE] * EXAMPLES
    return [{"input_ids": torch.randint(4, 128, (n,), generator=generator).tolist()} for n in lengths]


class _Record(TrainerCallback):
    """Notes where the parameters are and how they are sharded, at each step's end."""

    def __init__(self) -> None:
        self.devices: set[str] = set()
        self.placements: set[str] = set()
        self.local_fraction = 1.0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        for parameter in model.parameters():
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            self.devices.add(local.device.type)
            if hasattr(parameter, "placements"):
                self.placements.add(str(parameter.placements))
        total = sum(p.numel() for p in model.parameters())
        local_total = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        self.local_fraction = local_total / total


def train(folder: str | Path, output_dir: str | Path, *, device: str = "neuron", steps: int = 20,
          batch_size: int = 4, fsdp: bool = False, save_steps: int | None = None, resume: str | None = None,
          train_dataset: list | None = None, **arguments: Any) -> dict[str, Any]:
    """Fine-tunes the checkpoint in `folder` for `steps` steps of `batch_size` examples in all (split
    between the ranks of a distributed job) and returns what happened. `device="cpu"` is the
    reference run: Transformers' own model and Trainer on the CPU. Other keyword arguments go to
    `TrainingArguments`."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if device == "cpu":
        model = AutoModelForCausalLM.from_pretrained(folder)
    else:
        model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder)
    extra = {}
    if fsdp:
        extra = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True,
                                                       "state_dict_type": "SHARDED_STATE_DICT"}}
    args = TrainingArguments(
        output_dir, per_device_train_batch_size=batch_size // world, max_steps=steps, learning_rate=1e-3,
        lr_scheduler_type="constant",  # runs of different lengths stay comparable step by step
        logging_steps=1, report_to=[], save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        use_cpu=device == "cpu", disable_tqdm=True, seed=0, data_seed=0, **extra, **arguments,
    )
    train_dataset = train_dataset or [dict(e, labels=e["input_ids"]) for e in dataset()]
    record = _Record()
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, callbacks=[record])
    trainer.train(resume_from_checkpoint=resume)
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    return {"losses": losses, "devices": sorted(record.devices), "placements": sorted(record.placements),
            "local_fraction": record.local_fraction, "device": str(args.device),
            "distributed_type": str(trainer.accelerator.distributed_type),
            "mixed_precision": trainer.accelerator.mixed_precision, "adjustments": ont.training.active(),
            "torch_compile_backend": args.torch_compile_backend,
            "compile_dynamic": getattr(trainer.accelerator.state.dynamo_plugin, "dynamic", None),
            "versions": {"transformers": transformers.__version__, "accelerate": accelerate.__version__}}


if __name__ == "__main__":
    out, folder, *options = sys.argv[1:]
    kwargs = {key: json.loads(value) for key, value in (option.split("=", 1) for option in options)}
    result = train(folder, kwargs.pop("output_dir"), **kwargs)
    if int(os.environ.get("RANK", 0)) == 0:
        Path(out).write_text(json.dumps(result))
