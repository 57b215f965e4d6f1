"""Static shapes for training: batches padded to a few lengths and one batch size.

On TorchNeuron every new input shape is a new compile, and a data collator that pads each batch to
its longest example (Transformers' default) makes nearly every step a new shape. Padding to the
smallest of a few length buckets, and filling short batches with padding rows, bounds the compiled
training steps to one per bucket. Padding never changes the loss: padded positions are masked out
of attention and labelled -100 (ignored by the loss), and padding rows attend to themselves only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigurationError

IGNORE_INDEX = -100  # the label Transformers' losses ignore
DEFAULT_BUCKETS = (64, 128, 256, 512, 1024, 2048)


@dataclass
class BucketingDataCollator:
    """Pads a batch of tokenized examples (right side) to the smallest length bucket that holds its
    longest one and, with `batch_size`, to that many rows: every batch has one of
    `len(buckets)` shapes, so a compiled training step stops recompiling once each bucket was seen.

    Labels are the examples' `labels`, or their `input_ids` (causal language modelling) when they
    have none; the shift to next-token targets stays the model's. Padded positions get attention
    mask 0 and label -100; padding rows (to reach `batch_size`) are all padding with mask 1, so
    that their attention is well defined, and labels -100, so that they add nothing to the loss or
    its gradient.

    Args:
        pad_token_id (`int`):
            The id padded positions get (the tokenizer's `pad_token_id`, or its `eos_token_id`).
        buckets (`Sequence[int]`, *optional*, defaults to `(64, 128, 256, 512, 1024, 2048)`):
            The padded lengths, in increasing order.
        batch_size (`int`, *optional*):
            Pads every batch to this many rows (set it to the per-device batch size, so that the
            last, shorter batch of an epoch is not a new shape).

    Raises:
        [`~optimum_neuron_torch.errors.ConfigurationError`]:
            If `buckets` is empty or not increasing, or `batch_size` is below 1.

    Example:

    ```python
    >>> from transformers import Trainer, TrainingArguments
    >>> from optimum_neuron_torch.training import BucketingDataCollator

    >>> collator = BucketingDataCollator(tokenizer.pad_token_id, buckets=(128, 256, 512), batch_size=8)
    >>> args = TrainingArguments("out", per_device_train_batch_size=8, torch_compile=True)
    >>> Trainer(model=model, args=args, train_dataset=tokenized, data_collator=collator).train()
    ```
    """

    pad_token_id: int
    buckets: Sequence[int] = DEFAULT_BUCKETS
    batch_size: int | None = None

    def __post_init__(self) -> None:
        self.buckets = tuple(self.buckets)
        increasing = all(a < b for a, b in zip(self.buckets, self.buckets[1:], strict=False))
        if not self.buckets or not increasing or self.buckets[0] < 1:
            raise ConfigurationError(f"BucketingDataCollator: `buckets` must be increasing positive lengths, got "
                                     f"{self.buckets}.")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigurationError(f"BucketingDataCollator: `batch_size` must be at least 1, got {self.batch_size}.")

    def bucket(self, length: int) -> int:
        """The padded length of a batch whose longest example has `length` tokens.

        Raises:
            [`~optimum_neuron_torch.errors.ConfigurationError`]:
                If `length` is beyond the largest bucket.
        """
        for bucket in self.buckets:
            if length <= bucket:
                return bucket
        raise ConfigurationError(
            f"BucketingDataCollator: an example has {length} tokens, more than the largest bucket "
            f"({self.buckets[-1]}). Truncate the examples when tokenizing (truncation=True, "
            f"max_length={self.buckets[-1]}) or add a larger bucket."
        )

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        rows = len(features)
        if self.batch_size is not None and rows > self.batch_size:
            raise ConfigurationError(
                f"BucketingDataCollator: a batch of {rows} examples, more than batch_size={self.batch_size}; set "
                "batch_size to TrainingArguments.per_device_train_batch_size."
            )
        ids = [_as_list(feature["input_ids"], "input_ids") for feature in features]
        labels = [_as_list(feature.get("labels", feature["input_ids"]), "labels") for feature in features]
        for row, (token_ids, row_labels) in enumerate(zip(ids, labels, strict=True)):
            if len(row_labels) != len(token_ids):
                raise ConfigurationError(
                    f"BucketingDataCollator: example {row} has {len(token_ids)} input_ids but {len(row_labels)} "
                    "labels; they must be as long."
                )
        length = self.bucket(max(map(len, ids), default=1))
        total_rows = self.batch_size or rows
        batch = {
            "input_ids": torch.full((total_rows, length), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((total_rows, length), dtype=torch.long),
            "labels": torch.full((total_rows, length), IGNORE_INDEX, dtype=torch.long),
        }
        for row, (token_ids, row_labels) in enumerate(zip(ids, labels, strict=True)):
            batch["input_ids"][row, : len(token_ids)] = torch.tensor(token_ids)
            batch["attention_mask"][row, : len(token_ids)] = 1
            batch["labels"][row, : len(row_labels)] = torch.tensor(row_labels)
        batch["attention_mask"][rows:] = 1  # padding rows attend among themselves; their labels are all ignored
        return batch


def _as_list(value: Any, field: str) -> list[int]:
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).tolist()
    if isinstance(value, Sequence) and not isinstance(value, str):
        return list(value)
    raise ConfigurationError(f"BucketingDataCollator: `{field}` must be a list or tensor of token ids, got "
                             f"{type(value).__name__}.")
