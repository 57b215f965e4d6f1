"""Support profiles: which ATen ops count as native on the reference device.

The rule is the dispatcher's. An op reaches the device's boxed fallback only when PyTorch has
no kernel of its own for it on the device (composite kernels decompose first: a functional
`pow.Tensor_Scalar` reaches the device as `pow.Tensor_Scalar_out`). The profile then names the
overloads that are native, exactly as written in the op list (`aten::name` or
`aten::name.overload`); every other overload takes the counted fallback path. View and metadata
ops never count as fallbacks, as in TorchNeuron.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ...errors import ConfigurationError

TORCHNEURON = "torchneuron"
FULL = "full"
SHIPPED_OP_LIST = "torchneuron_native_ops.txt"

# View and metadata ops: they move no data, so like TorchNeuron's whitelist they are never
# counted as fallbacks, whatever the op list says.
VIEW_OPS = frozenset(
    f"aten::{name}"
    for name in (
        "view", "_unsafe_view", "view_as_real", "view_as_complex", "reshape", "_reshape_alias",
        "as_strided", "transpose.int", "t", "permute", "select.int", "slice.Tensor", "expand", "detach",
        "alias", "squeeze", "squeeze.dim", "squeeze.dims", "unsqueeze", "unfold", "diagonal", "narrow",
        "split.Tensor", "split_with_sizes", "unbind.int", "chunk", "_conj", "_neg_view", "lift_fresh",
        "set_", "set_.source_Storage", "set_.source_Storage_storage_offset", "set_.source_Tensor",
        "resize_", "empty.memory_format", "empty_strided", "_local_scalar_dense", "_copy_from",
        "_copy_from_and_resize", "_has_compatible_shallow_copy_type",
    )
)


# Ops whose composite kernels refuse devices other than CPU/CUDA/XPU: the device runs them itself.
DEVICE_ONLY_OPS = frozenset({"aten::mode", "aten::mode.values"})


@dataclass(frozen=True)
class Profile:
    """A named set of native ops; `native_ops` is None when every op is native."""

    name: str
    native_ops: frozenset[str] | None


def read_op_list(path: str | os.PathLike[str], text: str | None = None) -> frozenset[str]:
    """Reads an op list: one `aten::name[.overload]` a line; `#` starts a comment."""
    if text is None:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ConfigurationError(f"cannot read the op list {path}: {error.strerror}.") from error
    ops = set()
    for number, line in enumerate(text.splitlines(), start=1):
        op = line.split("#", 1)[0].strip()
        if not op:
            continue
        namespace, _, name = op.partition("::")
        if not namespace or not name or " " in op:
            raise ConfigurationError(
                f"{path}, line {number}: {line.strip()!r} is not an op name; write one op a line "
                "as namespace::name or namespace::name.overload (e.g. aten::add.out)."
            )
        ops.add(op)
    if not ops:
        raise ConfigurationError(f"the op list {path} names no op.")
    return frozenset(ops)


def shipped_op_list() -> frozenset[str]:
    """TorchNeuron's native ops, as extracted from its source (provenance in the file)."""
    resource = resources.files(__package__).joinpath(SHIPPED_OP_LIST)
    return read_op_list(str(resource), resource.read_text())


def load_profile(spec: str) -> Profile:
    """`torchneuron` (the shipped list), `full` (everything native), or the path of an op list."""
    if spec == TORCHNEURON:
        return Profile(TORCHNEURON, shipped_op_list())
    if spec == FULL:
        return Profile(FULL, None)
    if os.path.exists(spec):
        return Profile("custom", read_op_list(spec))
    raise ConfigurationError(
        f"unknown support profile {spec!r}: use 'torchneuron', 'full', or the path of an op list file "
        "(one aten::op a line, e.g. dumped on a Trn instance with "
        "torch._C._dispatch_get_registrations_for_dispatch_key('PrivateUse1'))."
    )
