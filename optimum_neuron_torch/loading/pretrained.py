"""`load_pretrained`: resolve -> build on meta -> check -> stream -> finalize."""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming
from transformers.distributed import DistributedConfig
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.models.auto.auto_factory import _BaseAutoModelClass, _get_model_class
from transformers.utils.generic import ContextManagers

from .. import settings
from ..errors import ArgumentTypeError, ConfigurationError, UnsupportedModelError
from . import sharding
from .checkpoint import GENERATION_CONFIG_NAME, Checkpoint, resolve_checkpoint
from .loader import _open, check_device_memory, finalize, plan_loading, release, stream_into
from .options import LoadOptions

logger = logging.getLogger(__name__)

DtypeLike = torch.dtype | str | None


def _model_class(
    model_class: type, config: PretrainedConfig, checkpoint: Checkpoint, trust_remote_code: bool
) -> type:
    """The concrete Transformers class: itself, or what an Auto class maps the config to."""
    if not issubclass(model_class, _BaseAutoModelClass):
        return model_class
    auto_name = next(c.__name__ for c in model_class.__mro__ if c.__module__.startswith("transformers.models.auto"))
    remote = getattr(config, "auto_map", {}).get(auto_name)
    if remote is not None and trust_remote_code:
        return get_class_from_dynamic_module(remote, str(checkpoint.folder))
    if type(config) in model_class._model_mapping:
        return _get_model_class(config, model_class._model_mapping)
    if remote is not None:
        raise ConfigurationError(
            f"{checkpoint.name} defines its model in its own code ({remote}); pass trust_remote_code=True "
            "if you trust that code (it runs on your machine)."
        )
    raise UnsupportedModelError(
        f"{model_class.__name__} has no model for a {type(config).__name__}; try another Neuron Auto class."
    )


def resolve_dtype(dtype: DtypeLike, config: PretrainedConfig, files: list) -> torch.dtype:
    """`None` and "auto" follow the config, then the checkpoint, as Transformers does."""
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None)
        if dtype is None:
            floating = [e.dtype for f in files for e in f.entries.values() if e.dtype.is_floating_point]
            dtype = floating[0] if floating else torch.float32
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ConfigurationError(f"dtype={dtype!r} is not a torch dtype")
        dtype = resolved
    return dtype


def build_on_meta(model_class: type, config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The model with every parameter and buffer on the meta device: no memory, no init cost."""
    config = copy.deepcopy(config)
    config.dtype = dtype
    with ContextManagers(model_class.get_init_context(dtype, False, False, None)):
        return model_class(config)


def load_pretrained(
    model_class: type,
    name_or_path: str | os.PathLike[str],
    options: LoadOptions | None = None,
    **config_kwargs: Any,
) -> PreTrainedModel:
    """Loads a Transformers model straight onto `options.device`, streaming its weights from disk.
    The local folder it was read from is kept as `model.neuron_checkpoint_folder`. The options are
    those of `NeuronAutoModel.from_pretrained` (which documents them), less `patches`;
    `config_kwargs` are config attributes to override.

    Under tensor parallelism (`distributed_config`, `tp_plan` or `tp_size`) every rank of the job
    runs this: each reads and keeps only its pieces of the split tensors, on its own device, and
    each step that can fail on one rank is agreed on by all before the next (see `sharding`).
    """
    options = options or LoadOptions()
    parallel = sharding.distributed_config(options.distributed_config, options.tp_plan, options.tp_size)
    mesh_manager = sharding.start(parallel) if parallel is not None else None

    def together(step: str, action: Callable[[], Any]) -> Any:
        """`action()`; under tensor parallelism every rank then learns whether it failed anywhere."""
        if parallel is None:
            return action()
        try:
            result = action()
        except Exception as error:
            sharding.agree(step, error)
        sharding.agree(step, None)
        return result

    def resolve(offline: bool) -> Checkpoint:
        return resolve_checkpoint(
            name_or_path, revision=options.revision, token=options.token, cache_dir=options.cache_dir,
            local_files_only=options.local_files_only or offline, allow_pickle=options.allow_pickle,
        )

    if parallel is None:
        checkpoint = resolve(offline=False)
    else:  # one download per host: its first rank downloads, the others then find the files in the cache
        first_on_host = settings.launcher_local_rank() == 0
        found = together("resolving the checkpoint", lambda: resolve(offline=False) if first_on_host else None)
        checkpoint = together("resolving the checkpoint", lambda: found or resolve(offline=True))
    config, unused = AutoConfig.from_pretrained(
        checkpoint.folder, trust_remote_code=options.trust_remote_code, return_unused_kwargs=True, **config_kwargs
    )
    if unused:
        raise ArgumentTypeError(
            f"from_pretrained() got arguments that are neither its own nor config attributes: {sorted(unused)}"
        )
    if options.attn_implementation is not None:
        config._attn_implementation = options.attn_implementation
    config.name_or_path = str(checkpoint.name)
    concrete = _model_class(model_class, config, checkpoint, options.trust_remote_code)
    device = torch.device(options.device)
    if device.index is None and device.type == "neuron":
        device = torch.device("neuron", torch.neuron.current_device())

    with ExitStack() as files_stack:

        def prepare() -> tuple:
            """Everything before the first allocation: the files checked, the model on meta, split
            by the plan, matched with the checkpoint, and measured against the free memory."""
            files = _open(checkpoint, files_stack)
            model_dtype = resolve_dtype(options.dtype, config, files)
            if parallel is not None:
                sharding.check_divisible(config, parallel.tp_size, checkpoint.name)
            model = build_on_meta(concrete, config, model_dtype)
            if parallel is not None:
                model = sharding.shard(model, parallel, mesh_manager, checkpoint.name)
            conversions = get_model_conversion_mapping(model, None, None)
            if any(not isinstance(c, WeightRenaming) for c in conversions):
                return model_dtype, model, None
            plan = plan_loading(model, checkpoint, files, conversions, options.ignore_mismatched_sizes)
            check_device_memory(model, device, checkpoint.name)
            return model_dtype, model, plan

        dtype, model, plan = together("checking the checkpoint", prepare)
        if plan is None:
            model = _load_with_transformers(
                concrete, checkpoint, dtype, device, options, config, parallel
            )
            model.neuron_checkpoint_folder = checkpoint.folder
            return model

        try:  # (finalizing runs collectives of its own, so every rank must have loaded first)
            together("loading the weights", lambda: stream_into(model, plan, device, checkpoint.name))
            info = together("finalizing the model",
                            lambda: finalize(model, plan, device, checkpoint.name, options.ignore_mismatched_sizes))
        except BaseException:  # this rank's failure or another's: no half-loaded model keeps device memory
            release(model)
            raise
    model.eval()
    if model.can_generate() and (checkpoint.folder / GENERATION_CONFIG_NAME).is_file():
        model.generation_config = GenerationConfig.from_pretrained(checkpoint.folder)
    model.neuron_loading_info = info.to_dict()
    model.neuron_checkpoint_folder = checkpoint.folder
    return model


def _load_with_transformers(
    model_class: type, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, options: LoadOptions,
    config: PretrainedConfig, parallel: DistributedConfig | None,
) -> PreTrainedModel:
    """Architectures whose checkpoints need tensor conversions (fused experts and the like) load
    through Transformers' own path on the host, then move to the device; under tensor parallelism
    Transformers' path shards on read and places each rank's pieces on its device itself."""
    logger.warning(
        "%s: %s converts checkpoint tensors on load; using Transformers' loader (on the host, not streamed).",
        checkpoint.name, model_class.__name__,
    )
    model = model_class.from_pretrained(
        checkpoint.folder, config=config, dtype=dtype, trust_remote_code=options.trust_remote_code,
        ignore_mismatched_sizes=options.ignore_mismatched_sizes, distributed_config=parallel,
    )
    return model if parallel is not None else model.to(device)
