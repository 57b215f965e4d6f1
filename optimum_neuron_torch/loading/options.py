"""`LoadOptions`: the arguments of `NeuronAutoModel*.from_pretrained` that choose how a checkpoint is
loaded, defined once here and passed down to the loader (`load_pretrained`); `from_pretrained`'s
docstring documents them."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers.distributed import DistributedConfig


@dataclass(frozen=True)
class LoadOptions:
    """How to load a checkpoint (see `NeuronAutoModel.from_pretrained` for each field).

    Args:
        revision (`str`, *optional*): the Hub revision to download.
        dtype (`torch.dtype` or `str`, *optional*): the weights' dtype (default: the checkpoint's).
        device (`torch.device` or `str`, defaults to `"neuron"`): where to load the model.
        token (`str` or `bool`, *optional*): the Hub token.
        cache_dir (`str` or `os.PathLike`, *optional*): the Hugging Face cache folder.
        local_files_only (`bool`, defaults to `False`): use only files already in the cache.
        trust_remote_code (`bool`, defaults to `False`): run the model code a checkpoint ships.
        allow_pickle (`bool`, defaults to `False`): load pickled weights when there are no safetensors.
        ignore_mismatched_sizes (`bool`, defaults to `False`): initialize weights whose shape differs.
        attn_implementation (`str`, *optional*): the attention implementation, as in Transformers.
        distributed_config (`DistributedConfig` or `dict`, *optional*): tensor parallelism.
        tp_plan (`str` or `dict`, *optional*): the older form of `distributed_config`'s `tp_plan`.
        tp_size (`int`, *optional*): the older form of `distributed_config`'s `tp_size`.

    Example:
        >>> options, config_kwargs = LoadOptions.split({"dtype": "bfloat16", "num_labels": 3})
        >>> options.dtype, config_kwargs
        ('bfloat16', {'num_labels': 3})
    """

    revision: str | None = None
    dtype: torch.dtype | str | None = None
    device: torch.device | str = "neuron"
    token: str | bool | None = None
    cache_dir: str | os.PathLike[str] | None = None
    local_files_only: bool = False
    trust_remote_code: bool = False
    allow_pickle: bool = False
    ignore_mismatched_sizes: bool = False
    attn_implementation: str | None = None
    distributed_config: DistributedConfig | dict | None = None
    tp_plan: str | dict[str, str] | None = None
    tp_size: int | None = None

    @classmethod
    def split(cls, kwargs: dict[str, Any]) -> tuple[LoadOptions, dict[str, Any]]:
        """The loading options among `kwargs`, and the rest (config attributes to override)."""
        names = {field.name for field in dataclasses.fields(cls)}
        return (cls(**{name: value for name, value in kwargs.items() if name in names}),
                {name: value for name, value in kwargs.items() if name not in names})
