"""Streaming a checkpoint onto the device.

The model is built on the meta device; then every tensor of every shard goes from the
memory-mapped file straight into a device tensor of the model's dtype (the copy casts on the
way: one pass over the data), one tensor at a time, and its file pages are released. Before any
device memory is taken the whole checkpoint is checked (headers, index, shapes) and the bytes the
model needs are compared with the device's free memory. Whatever goes wrong, no half-loaded model
is left behind and the device memory taken is given back.

Missing, unexpected and mismatched keys, tied weights and non-persistent buffers (rotary
`inv_freq` and the like) are then handled by Transformers' own finalization, so they are
initialized and reported exactly as `from_pretrained` does.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from huggingface_hub.utils import tqdm as hub_tqdm
from transformers import PreTrainedModel
from transformers.core_model_loading import WeightRenaming
from transformers.modeling_utils import LoadStateDictConfig
from transformers.utils.loading_report import LoadStateDictInfo

from ..device import mem_get_info
from ..errors import CheckpointError, InsufficientDeviceMemoryError
from .checkpoint import Checkpoint
from .pickled_file import PickledFile
from .safetensors_file import SafetensorsFile
from .sharding import as_parameter_value, local_bytes, local_piece, local_shape

logger = logging.getLogger(__name__)


@dataclass
class _Plan:
    """What goes where: checkpoint tensor -> model key, and what the checkpoint lacks or adds."""

    targets: dict[str, tuple[Any, str]] = field(default_factory=dict)  # model key -> (file, checkpoint name)
    unexpected: set[str] = field(default_factory=set)
    mismatched: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=set)


def _open(checkpoint: Checkpoint, stack: ExitStack) -> list:
    opener = PickledFile if checkpoint.pickled else SafetensorsFile
    return [stack.enter_context(opener(path)) for path in checkpoint.shards]


def _model_key(name: str, model_keys: dict[str, torch.Tensor], renamings: list[WeightRenaming],
               prefix: str) -> str | None:
    for renaming in renamings:
        name, _ = renaming.rename_source_key(name)
    if name in model_keys:
        return name
    if prefix and f"{prefix}.{name}" in model_keys:  # a base model's weights into a model with a head
        return f"{prefix}.{name}"
    if prefix and name.startswith(f"{prefix}.") and name[len(prefix) + 1 :] in model_keys:  # the other way round
        return name[len(prefix) + 1 :]
    return None


def plan_loading(
    model: PreTrainedModel, checkpoint: Checkpoint, files: list, renamings: list[WeightRenaming],
    ignore_mismatched_sizes: bool
) -> _Plan:
    """Matches checkpoint tensors to model keys and checks the checkpoint against the model.
    The targets come in file order, then byte order, the order to read them in."""
    model_keys = model.state_dict()
    seen: dict[str, Any] = {}
    plan = _Plan()
    for file in files:
        for name, entry in sorted(file.entries.items(), key=lambda item: item[1].start):
            if name in seen:
                raise CheckpointError(
                    f"the tensor is also in {seen[name].path.name}: a checkpoint names each tensor once",
                    file=str(file.path), tensor=name
                )
            seen[name] = file
            key = _model_key(name, model_keys, renamings, model.base_model_prefix)
            if key is None:
                plan.unexpected.add(name)
                continue
            expected_shape = tuple(model_keys[key].shape)
            if entry.shape != expected_shape:
                if not ignore_mismatched_sizes:
                    raise CheckpointError(
                        f"its shape {list(entry.shape)} does not match the model's {list(expected_shape)} for {key} "
                        f"(config {model.config.__class__.__name__}); check that the config belongs to these weights, "
                        "or pass ignore_mismatched_sizes=True to initialize the mismatched weights afresh",
                        file=str(file.path), tensor=name,
                    )
                plan.mismatched.add((key, entry.shape, expected_shape))
                continue
            # A tied weight stored in the checkpoint is loaded too: Transformers' finalization then ties it
            # when it equals its source, and leaves it untied when it differs, as its own loading does.
            plan.targets[key] = (file, name)
    if checkpoint.index is not None:
        for name, shard in checkpoint.index.items():
            if name not in seen or seen[name].path != shard:  # (not where the index says: refused, not skipped)
                raise CheckpointError(
                    f"the index places the tensor in {shard.name}, which does not contain it",
                    file=str(shard), tensor=name
                )
    return plan


def _tied_targets(model: PreTrainedModel) -> set[str]:
    """Keys of weights tied to another (one tensor once the model is tied, two before)."""
    return set(getattr(model, "all_tied_weights_keys", {}) or {})


def _device_bytes(model: PreTrainedModel) -> int:
    """Bytes of every parameter and buffer the loaded model holds on the device (tied ones once:
    on the meta model they are not tied yet; this rank's pieces of a tensor-parallel model)."""
    tied_targets = _tied_targets(model)
    tensors = {key: t for key, t in model.state_dict(keep_vars=True).items() if key not in tied_targets}
    tensors.update(model.named_buffers())
    unique = {id(t): t for t in tensors.values()}
    return sum(local_bytes(t) for t in unique.values())


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"


def check_device_memory(model: PreTrainedModel, device: torch.device, name: str) -> None:
    """Refuses a model that cannot fit, before anything is loaded."""
    needed = _device_bytes(model)
    free, total = mem_get_info(device)
    if not total:  # (the backend does not know this device's memory: nothing to check against)
        logger.info("%s: the memory of %s is unknown to the backend (total_memory 0); the check that %s fits "
                    "is skipped", name, device, _size(needed))
        return
    if needed > free:  # the blocks the caching allocator keeps for reuse are free too: return them, and ask again
        torch.neuron.empty_cache()
        free, total = mem_get_info(device)
    if needed > free:
        raise InsufficientDeviceMemoryError(
            f"{name} needs {_size(needed)} of device memory in {next(model.parameters()).dtype} but {device} has "
            f"{_size(free)} free (of {_size(total)}). Load it in a smaller dtype (dtype=torch.bfloat16), free "
            "device memory (del unused models), or use another device."
        )


def _set_tensor(model: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    module_name, _, attribute = key.rpartition(".")
    module = model.get_submodule(module_name)
    if attribute in module._parameters:
        old = module._parameters[attribute]
        module._parameters[attribute] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
        module._parameters[attribute]._is_hf_initialized = True
    else:
        module._buffers[attribute] = value
        value._is_hf_initialized = True


def release(model: torch.nn.Module) -> None:
    """Gives back every device tensor of a model that will not be returned."""
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for attribute, tensor in tensors.items():
                if tensor is not None and tensor.device.type != "meta":
                    tensors[attribute] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def _progress(total: int, name: str) -> hub_tqdm:
    quiet = dist.is_initialized() and dist.get_rank() != 0  # one bar for a job of several ranks, not one per rank
    return hub_tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"Loading {name}", leave=False,
                    disable=quiet)


def stream_into(model: PreTrainedModel, plan: _Plan, device: torch.device, name: str) -> None:
    """Copies every planned tensor onto the device, in the plan's (file) order. Of a parameter
    split between ranks (a DTensor), only this rank's piece is read and copied."""
    meta = model.state_dict()
    with _progress(sum(file.entries[tensor].nbytes for file, tensor in plan.targets.values()), name) as progress:
        previous_file = None
        for key, (file, tensor) in plan.targets.items():
            if file is not previous_file:
                file.prefetch()
                previous_file = file
            reference = meta[key]
            value = None
            source = None
            try:
                value = torch.empty(local_shape(reference), dtype=reference.dtype, device=device)
                source = file.tensor(tensor, local_piece(reference))
                value.copy_(source)
                _set_tensor(model, key, as_parameter_value(value, reference))
            finally:
                # Frames stay alive in a traceback: never let them hold device memory or a mapping.
                value = source = None
            file.release(tensor)
            progress.update(file.entries[tensor].nbytes)


def finalize(model: PreTrainedModel, plan: _Plan, device: torch.device, name: str,
             ignore_mismatched_sizes: bool) -> LoadStateDictInfo:
    """Transformers' own finalization: missing keys, non-persistent buffers, tying, the report."""
    info = LoadStateDictInfo(
        missing_keys=set(model.state_dict()) - set(plan.targets) - {key for key, _, _ in plan.mismatched},
        unexpected_keys=plan.unexpected,
        mismatched_keys=plan.mismatched,
        error_msgs=[],
        conversion_errors={},
        skipped_pp_keys=set(),
    )
    config = LoadStateDictConfig(
        pretrained_model_name_or_path=name, ignore_mismatched_sizes=ignore_mismatched_sizes, device_map={"": device}
    )
    return type(model)._finalize_model_loading(model, config, info)
