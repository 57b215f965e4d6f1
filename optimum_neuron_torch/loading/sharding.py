"""Loading a model split between ranks (tensor parallelism): each rank keeps, and reads from
disk, only its slices.

Transformers shards a model by its own tensor-parallel plan (`base_model_tp_plan`: which layers
are split by rows or columns, DTensor over a DeviceMesh). Its `prepare_distribute_model` starts
the mesh, and its `maybe_distribute_model` turns the meta model's parameters into meta DTensors
with the plan's placements and installs the hooks that gather and reduce around the split layers.
The streaming loader drives those two steps, then reads into each DTensor only this rank's piece
of the checkpoint tensor (`local_piece`, Transformers' own `DtensorShardOperation` over the
memory-mapped file). This module adds what the loader needs around them: the arguments as
Transformers takes them, the checks that fail before any allocation, and `agree`, which makes
every rank fail, naming the rank and the cause, when one rank does.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig, PreTrainedModel
from transformers.distributed import DistributedConfig
from transformers.distributed.sharding_utils import DtensorShardOperation

from .. import object_collectives, settings
from ..errors import ConfigurationError, RankFailedError, UnsupportedModelError, first_line

# Config attributes whose value the tensor-parallel degree must divide: attention heads are split
# whole between the ranks, and so are experts where the plan splits them by expert.
_DIVIDED_COUNTS = (
    ("num_attention_heads", "attention heads"),
    ("num_key_value_heads", "key-value heads"),
    ("num_local_experts", "experts"),
    ("num_experts", "experts"),
)


def distributed_config(
    config: DistributedConfig | dict | None, tp_plan: str | dict[str, str] | None, tp_size: int | None
) -> DistributedConfig | None:
    """The parallelism asked for, from `from_pretrained`'s arguments as Transformers takes them
    (`distributed_config`, or the older `tp_plan` / `tp_size`); None for a single device.

    Raises:
        ConfigurationError: both forms given, or a parallelism other than tensor parallelism.
    """
    if config is not None and (tp_plan is not None or tp_size is not None):
        raise ConfigurationError(
            "pass either distributed_config or tp_plan / tp_size, not both (set them on DistributedConfig)"
        )
    if config is None:
        if tp_plan is None and tp_size is None:
            return None
        config = DistributedConfig(tp_plan=tp_plan, tp_size=tp_size)
    elif isinstance(config, dict):
        config = DistributedConfig.from_dict(config)
    others = {name: getattr(config, name) for name in ("fsdp_size", "dp_replicate_size", "pp_size", "ep_size")}
    if any(size != 1 for size in others.values()):
        raise ConfigurationError(
            f"from_pretrained() shards models by tensor parallelism only (tp_size), but {config!r} asks for "
            f"{', '.join(f'{name}={size}' for name, size in others.items() if size != 1)}; load with "
            "Transformers' own from_pretrained for FSDP, pipeline or expert parallelism."
        )
    return config if config.tp_size > 1 else None


def start(config: DistributedConfig) -> Any:
    """Starts the job's `neuron` process group (unless the script did) and Transformers' device
    mesh; returns the mesh manager `maybe_distribute_model` takes.

    Raises:
        ConfigurationError: the job's number of processes differs from `tp_size`, or a rank cannot have a
            NeuronCore of its own (named, with how it was launched and the fix).
        RankFailedError: another rank could not select its NeuronCore.
    """
    processes = dist.get_world_size() if dist.is_initialized() else settings.launcher_world_size()
    if processes != config.tp_size:
        raise ConfigurationError(
            f"tp_size={config.tp_size} asks for {config.tp_size} ranks but this job has {processes} process(es) "
            f"(WORLD_SIZE); start it with `torchrun --nproc-per-node {config.tp_size} ...`, or pass "
            f"tp_size={processes}."
        )
    if not dist.is_initialized():
        # The group first: TorchNeuron's setup gives each process its core (NEURON_RT_VISIBLE_CORES) and
        # numbers devices from the local rank; before it, a process launched with one visible core has
        # device 0 only, and set_device(local_rank) fails on every rank but the first.
        visible = settings.visible_cores()  # (as launched: TorchNeuron's setup sets it when it is not)
        try:
            dist.init_process_group("neuron", timeout=timedelta(seconds=settings.distributed_timeout()))
        except AssertionError as error:
            if "more than one device per process" not in str(error):  # (TorchNeuron's setup asserts it)
                raise
            raise _core_error(settings.launcher_rank(), error, visible) from error
        agree("selecting its NeuronCore", _select_core(visible))
    _, _, mesh_manager = PreTrainedModel.prepare_distribute_model(config)
    return mesh_manager


def _select_core(visible: str | None) -> ConfigurationError | None:
    """Makes this rank's core (its local rank's) the current device; returns the error naming the rank,
    what it was launched with (`visible`: its NEURON_RT_VISIBLE_CORES) and the fix, when it cannot."""
    try:
        torch.neuron.set_device(settings.launcher_local_rank())
    except (RuntimeError, ValueError) as error:
        return _core_error(dist.get_rank(), error, visible)
    return None


def _core_error(rank: int, error: BaseException, visible: str | None) -> ConfigurationError:
    """The error of a rank that cannot have a NeuronCore of its own, with how it was launched and the fix."""
    return ConfigurationError(
        f"rank {rank} (local rank {settings.launcher_local_rank()}) cannot have a NeuronCore of its own: "
        f"{type(error).__name__}: {first_line(error)}. It was launched with NEURON_RT_VISIBLE_CORES={visible!r}. "
        "Launch one process per core with torchrun and leave NEURON_RT_VISIBLE_CORES unset (the process group "
        "gives each rank the core of its local rank), or set it to one core per rank, different on each rank."
    )


def check_divisible(config: PretrainedConfig, tp_size: int, name: str) -> None:
    """Refuses a degree that does not split the heads (and experts) evenly, before any allocation:
    Transformers would split a head between two ranks and compute garbage.

    Raises:
        ConfigurationError: naming the counts and the degrees that divide them.
    """
    text_config = config.get_text_config()
    counts = {}
    for attribute, meaning in _DIVIDED_COUNTS:
        value = getattr(text_config, attribute, None)
        if isinstance(value, int) and value > 0:
            counts[meaning] = value
    if all(value % tp_size == 0 for value in counts.values()):
        return
    described = " and ".join(f"{value} {meaning}" for meaning, value in counts.items())
    degrees = [d for d in range(1, max(counts.values()) + 1) if all(v % d == 0 for v in counts.values())]
    raise ConfigurationError(
        f"{name} has {described}: tp_size={tp_size} does not divide them, so a head would be split between "
        f"ranks. Use a tp_size that divides them: {', '.join(map(str, degrees))}."
    )


def shard(model: PreTrainedModel, config: DistributedConfig, mesh_manager: Any, name: str) -> PreTrainedModel:
    """Applies the model's tensor-parallel plan to the model on the meta device (nothing allocated).

    Raises:
        UnsupportedModelError: the model has no tensor-parallel plan and none was given.
        ConfigurationError: a parameter the plan splits has a size the degree does not divide.
    """
    if not model.tp_plan and not isinstance(config.tp_plan, dict):
        raise UnsupportedModelError(
            f"{name} ({model.config.model_type}) has no tensor-parallel plan in Transformers (its config has no "
            "base_model_tp_plan), so it cannot be split between ranks. Load it on one device (no tp_size), or "
            "give a plan: distributed_config=DistributedConfig(tp_size=N, tp_plan={'layers.*.self_attn.q_proj': "
            "'colwise', ...})."
        )
    model = type(model).maybe_distribute_model(model, config, mesh_manager)
    for key, parameter in model.named_parameters():
        if isinstance(parameter, DTensor):
            for placement in parameter.placements:
                dim = getattr(placement, "dim", None)
                if dim is not None and parameter.shape[dim] % config.tp_size:
                    raise ConfigurationError(
                        f"{name}: {key} has {parameter.shape[dim]} rows along the dimension the tensor-parallel "
                        f"plan splits, which tp_size={config.tp_size} does not divide; use a tp_size that does."
                    )
    return model


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of a tensor: its local piece for a DTensor."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def local_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape this rank holds of a tensor: its local piece's for a DTensor."""
    return tensor._local_tensor.shape if isinstance(tensor, DTensor) else tensor.shape


def local_piece(parameter: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The function that selects this rank's piece of the checkpoint tensor of `parameter` (a view
    for the usual row or column split: only its bytes are read); None when the rank keeps it all."""
    if not isinstance(parameter, DTensor):
        return None
    operation = DtensorShardOperation(parameter)
    return operation.shard_tensor


def as_parameter_value(value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """`value` (this rank's piece) as the tensor the model keeps: the DTensor of `reference`'s mesh,
    placements and global shape when `reference` is one."""
    if not isinstance(reference, DTensor):
        return value
    return DTensor.from_local(value, reference.device_mesh, reference.placements, run_check=False,
                              shape=reference.shape, stride=reference.stride())


def agree(step: str, error: BaseException | None) -> None:
    """Tells every rank how `step` went on the others. Every rank calls it, whether its own step
    failed (`error`) or not; then a rank that failed raises its own error, and the others raise
    `RankFailedError` naming the failed ranks and their errors, so no rank goes on to wait in a
    collective that a failed rank will never join.

    Raises:
        RankFailedError: another rank failed at `step`.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    outcome = None if error is None else f"{type(error).__name__}: {first_line(error)}"
    outcomes = object_collectives.all_gather(outcome, what=step)
    if error is not None:
        raise error
    failed = {rank: outcome for rank, outcome in enumerate(outcomes) if outcome is not None}
    if failed:
        raise RankFailedError(
            f"rank {dist.get_rank()} stops {step}: "
            + "; ".join(f"rank {rank} failed: {outcome}" for rank, outcome in failed.items())
        )
