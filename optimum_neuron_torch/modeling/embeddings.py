"""Sentence embeddings from a `NeuronAutoModel`: pool the hidden states, then normalize.

Reads the pooling of a sentence-transformers folder (`modules.json`, `1_Pooling/config.json`)
when there is one, so such a model embeds as sentence-transformers would, without needing it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

POOLING_MODES = ("mean", "cls", "max")


def sentence_transformers_pooling(folder: str | Path) -> tuple[str, bool]:
    """(pooling mode, normalize) declared by a sentence-transformers folder; ("mean", False) otherwise."""
    folder = Path(folder)
    pooling, normalize = "mean", False
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return pooling, normalize
    for module in json.loads(modules_file.read_text()):
        kind = module.get("type", "")
        if kind.endswith("models.Pooling"):
            config = json.loads((folder / module["path"] / "config.json").read_text())
            modes = [mode for mode in POOLING_MODES if config.get(f"pooling_mode_{mode}_tokens" if mode != "cls" else "pooling_mode_cls_token")]
            if len(modes) != 1:
                raise ValueError(f"{folder}: unsupported pooling configuration {config}; supported: one of {POOLING_MODES}")
            pooling = modes[0]
        elif kind.endswith("models.Normalize"):
            normalize = True
    return pooling, normalize


def pool(hidden_states: torch.Tensor, attention_mask: torch.Tensor, mode: str = "mean") -> torch.Tensor:
    """One vector per sequence from token vectors, ignoring padding."""
    mask = attention_mask.unsqueeze(-1).to(hidden_states.dtype)
    if mode == "mean":
        return (hidden_states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    if mode == "cls":
        return hidden_states[:, 0]
    if mode == "max":
        return hidden_states.masked_fill(mask == 0, torch.finfo(hidden_states.dtype).min).amax(dim=1)
    raise ValueError(f"unknown pooling {mode!r}; use one of {POOLING_MODES}")


@torch.no_grad()
def embed(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: list[str],
    *,
    pooling: str | None = None,
    normalize: bool | None = None,
    batch_size: int = 32,
) -> torch.Tensor:
    """Embeddings of `sentences`, on the model's device. Pooling and normalization default to what
    the model's folder declares (sentence-transformers layout), else mean pooling, no normalization."""
    declared = sentence_transformers_pooling(model.name_or_path) if Path(model.name_or_path).is_dir() else ("mean", False)
    pooling = pooling or declared[0]
    normalize = declared[1] if normalize is None else normalize
    device = next(model.parameters()).device
    batches = []
    for start in range(0, len(sentences), batch_size):
        inputs = tokenizer(sentences[start : start + batch_size], padding=True, truncation=True, return_tensors="pt").to(device)
        hidden = model(**inputs).last_hidden_state
        vectors = pool(hidden, inputs["attention_mask"], pooling)
        batches.append(torch.nn.functional.normalize(vectors, dim=-1) if normalize else vectors)
    return torch.cat(batches)
