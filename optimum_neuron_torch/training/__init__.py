"""Fine-tuning on `neuron` with Transformers' `Trainer`: the adjustments that let it use the device
(`trainer_integration`), activation checkpointing that compiles (`activation_checkpointing`), and a data
collator that keeps training shapes static (`collator`)."""

from .activation_checkpointing import SAVE_RANDOM_OPS, save_random_ops_when_checkpointing
from .collator import BucketingDataCollator
from .trainer_integration import ADJUSTMENTS, active, disable, enable

__all__ = [
    "ADJUSTMENTS",
    "SAVE_RANDOM_OPS",
    "BucketingDataCollator",
    "active",
    "disable",
    "enable",
    "save_random_ops_when_checkpointing",
]
