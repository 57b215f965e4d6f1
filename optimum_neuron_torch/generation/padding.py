"""How a generate() call is padded to its buckets, and its output unpadded.

Compiled generation runs fixed shapes: a call's rows are filled up to the batch bucket with copies
of its first row (finished from the first token), and its prompt is padded up to the prompt bucket
with masked pad tokens: on the left for decoders, as Transformers pads batches for generation, on
the right for encoders, whose positions then stay the same. Afterwards the output is cut back to
the rows and columns the unpadded call would have returned.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation import StoppingCriteria
from transformers.generation.streamers import BaseStreamer
from transformers.utils import ModelOutput


def pad_token_id(config: GenerationConfig, vocab_size: int) -> int:
    """A token id for the padding (masked, so any id in the vocabulary): the pad token, else 0."""
    pad = config.pad_token_id
    return int(pad) if isinstance(pad, int) and 0 <= pad < vocab_size else 0


def default_attention_mask(input_ids: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """The mask Transformers infers when none is given: pad tokens are masked when the pad token
    is not also an end-of-sequence token."""
    pad = config.pad_token_id
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    if pad is not None and pad not in eos and bool((input_ids == pad).any()):
        return (input_ids != pad).long()
    return torch.ones_like(input_ids, dtype=torch.long)


def fill_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` rows: the given ones, then copies of the first (see `PaddingRowsDone`)."""
    return fill_batch(input_ids, batch), fill_batch(attention_mask, batch)


def fill_batch(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """`tensor` with `batch` rows (its first dimension): its own, then copies of the first."""
    return torch.cat([tensor, tensor[:1].expand(batch - tensor.shape[0], *tensor.shape[1:])])


def pad_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor, length: int, pad_id: int, *,
               left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and mask padded to `length` columns with `pad_id`, masked out, on the left or the right."""
    rows, pad = input_ids.shape[0], length - input_ids.shape[1]
    id_padding = torch.full((rows, pad), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    mask_padding = torch.zeros((rows, pad), dtype=attention_mask.dtype, device=attention_mask.device)
    if left:
        return torch.cat([id_padding, input_ids], dim=1), torch.cat([mask_padding, attention_mask], dim=1)
    return torch.cat([input_ids, id_padding], dim=1), torch.cat([attention_mask, mask_padding], dim=1)


def unpad(output: Any, rows: int, columns: int, device: torch.device) -> Any:
    """The output of a padded generate() call (a tensor of sequences or a `ModelOutput`) without
    rows past `rows` and sequence columns before `columns`, on `device`. The cache is dropped from
    a `ModelOutput`: it is the model's static cache, reused by the next call."""
    if isinstance(output, torch.Tensor):
        return output[:rows, columns:].to(device)
    output.sequences = output.sequences[:rows, columns:].to(device)
    for name in ("scores", "logits"):
        if getattr(output, name, None) is not None:
            setattr(output, name, tuple(step[:rows].to(device) for step in getattr(output, name)))
    if isinstance(output, ModelOutput) and "cache" in output:
        output.cache = None
    return output


def unpad_rows(output: Any, rows: int, device: torch.device) -> Any:
    """The output of a generate() call whose batch was filled (`fill_batch`), cut back to its first
    `rows`, on `device`: a tensor of sequences, or a dict (or `ModelOutput`) of tensors of a row
    each, lists of a row each (Whisper's segments) and tuples of a tensor per step (scores)."""
    if isinstance(output, torch.Tensor):
        return output[:rows].to(device)
    for name, value in list(output.items()):
        if isinstance(value, torch.Tensor):
            output[name] = value[:rows].to(device)
        elif isinstance(value, list):
            output[name] = value[:rows]
        elif isinstance(value, tuple) and all(isinstance(step, torch.Tensor) for step in value):
            output[name] = tuple(step[:rows].to(device) for step in value)
    if "cache" in output:  # (the model's static cache, reused by the next call)
        output["cache"] = None
    return output


class PaddingRowsDone(StoppingCriteria):
    """Marks the rows added to fill a batch bucket (those from index `rows` on) as finished from
    the first token."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        done[self.rows:] = True
        return done


class UnpaddedStreamer(BaseStreamer):
    """Hands a streamer the prompt without the `padding` columns added on the left."""

    def __init__(self, streamer: BaseStreamer, padding: int) -> None:
        self.streamer, self.padding, self.first = streamer, padding, True

    def put(self, value: torch.Tensor) -> None:
        if self.first:
            self.first, value = False, value[..., self.padding:]
        self.streamer.put(value)

    def end(self) -> None:
        self.streamer.end()


class PromptStreamed(BaseStreamer):
    """A streamer that has received the prompt already: the prompt that a second generate() run
    of the same call puts again is dropped."""

    def __init__(self, streamer: BaseStreamer) -> None:
        self.streamer, self.first = streamer, True

    def put(self, value: torch.Tensor) -> None:
        if self.first:
            self.first = False
            return
        self.streamer.put(value)

    def end(self) -> None:
        self.streamer.end()


def prompt_streamed(kwargs: dict[str, Any], streamer: UnpaddedStreamer | None) -> dict[str, Any]:
    """`kwargs` for generating again after a compiled call failed, its streamer told that it has
    the prompt already if the failed call streamed it."""
    if isinstance(streamer, UnpaddedStreamer) and not streamer.first:
        return {**kwargs, "streamer": PromptStreamed(streamer.streamer)}
    return kwargs
