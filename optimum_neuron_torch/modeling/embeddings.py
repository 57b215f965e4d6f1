"""Sentence embeddings from a `NeuronAutoModel`: pool the hidden states, then normalize.

Reads the pooling of a sentence-transformers folder (`modules.json`, `1_Pooling/config.json`)
when there is one, so such a model embeds as sentence-transformers would, without needing it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..errors import ConfigurationError

POOLING_MODES = ("mean", "cls", "max")
# The key of each mode in a sentence-transformers `1_Pooling/config.json`.
_POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens"}


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
            modes = [mode for mode in POOLING_MODES if config.get(_POOLING_KEYS[mode])]
            if len(modes) != 1:
                raise ConfigurationError(
                    f"{folder}: unsupported pooling configuration {config}; supported: one of {POOLING_MODES}"
                )
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
    raise ConfigurationError(f"unknown pooling {mode!r}; use one of {POOLING_MODES}")


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
    """Sentence embeddings: the model's last hidden states pooled over each sentence's tokens
    (padding ignored), then optionally normalized, computed on the model's device in batches.

    Args:
        model ([`~transformers.PreTrainedModel`]):
            A base model returning `last_hidden_state`, e.g. from `NeuronAutoModel.from_pretrained`.
        tokenizer ([`~transformers.PreTrainedTokenizerBase`]):
            The model's tokenizer.
        sentences (`list[str]`):
            The sentences to embed.
        pooling (`str`, *optional*):
            `"mean"`, `"cls"` or `"max"`; defaults to what the model's folder declares
            (sentence-transformers layout: `modules.json`, `1_Pooling/config.json`), else `"mean"`.
        normalize (`bool`, *optional*):
            Whether to scale each embedding to unit length; defaults to what the folder declares
            (a `Normalize` module), else `False`.
        batch_size (`int`, *optional*, defaults to 32):
            How many sentences go through the model at once.

    Returns:
        `torch.Tensor`: the embeddings, one row per sentence (`(len(sentences), hidden_size)`), on
        the model's device.

    Raises:
        [`~optimum_neuron_torch.errors.ConfigurationError`]:
            If `pooling` is not a known mode, or the folder declares a pooling this function does not
            do (none or several modes).

    Example:

    ```python
    >>> import torch
    >>> from transformers import AutoTokenizer
    >>> from optimum_neuron_torch import NeuronAutoModel, embed

    >>> model = NeuronAutoModel.from_pretrained("sentence-transformers/all-MiniLM-L6-v2")
    >>> tokenizer = AutoTokenizer.from_pretrained("sentence-transformers/all-MiniLM-L6-v2")
    >>> vectors = embed(model, tokenizer, ["A cat sits.", "A dog runs."])
    >>> vectors.shape
    torch.Size([2, 384])
    >>> torch.nn.functional.cosine_similarity(vectors[0], vectors[1], dim=0)
    ```
    """
    folder = Path(model.name_or_path)
    declared = sentence_transformers_pooling(folder) if folder.is_dir() else ("mean", False)
    pooling = pooling or declared[0]
    normalize = declared[1] if normalize is None else normalize
    device = next(model.parameters()).device
    batches = []
    for start in range(0, len(sentences), batch_size):
        batch = sentences[start : start + batch_size]
        inputs = tokenizer(batch, padding=True, truncation=True, return_tensors="pt").to(device)
        hidden = model(**inputs).last_hidden_state
        vectors = pool(hidden, inputs["attention_mask"], pooling)
        batches.append(torch.nn.functional.normalize(vectors, dim=-1) if normalize else vectors)
    return torch.cat(batches)
