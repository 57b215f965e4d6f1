"""Finding a checkpoint: a local folder, or a Hub repository through huggingface_hub.

Only the files a model needs are fetched: config, generation config, the safetensors index and
the shards it names (or the single weights file), and the compiled-generation spec with its
compiled graphs when the model was saved precompiled. `revision`, `token`, `cache_dir`,
`local_files_only` and `HF_HUB_OFFLINE` mean what they mean to huggingface_hub, whose own
resolution code runs (so a Hugging Face cache folder works offline).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError

from ..errors import CheckpointError, CheckpointNotFoundError, UnsafeCheckpointError

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
PICKLE_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
NEURON_GENERATION_NAME = "neuron_generation.json"  # buckets and compile settings of compiled generation
NEURON_COMPILED_DIR = "neuron_compiled"  # its compiled graphs, one compile-cache entry per folder


@dataclass(frozen=True)
class Checkpoint:
    """The files of a checkpoint, all local."""

    name: str  # what the user asked for
    folder: Path  # holds config.json
    shards: tuple[Path, ...]  # weight files
    index: dict[str, Path] | None  # tensor name -> shard, for sharded checkpoints
    pickled: bool = False


def _pickle_refusal(name: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{name} has only pickled weights ({PICKLE_WEIGHTS_NAME}), which can run arbitrary code when loaded. "
        "Convert them once to safetensors (e.g. `model.save_pretrained(folder, safe_serialization=True)` in a "
        "trusted environment), or pass allow_pickle=True to load them with torch.load(weights_only=True)."
    )


def _read_index(index_path: Path, folder: Path) -> dict[str, Path]:
    """tensor name -> shard path, every shard inside `folder`."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"not a valid index (a JSON object with a weight_map): {error}", file=str(index_path)
        ) from error
    if not isinstance(weight_map, dict):
        raise CheckpointError("weight_map is not an object", file=str(index_path))
    shards: dict[str, Path] = {}
    paths: dict[str, Path] = {}  # one Path per shard, however many tensors it holds
    inside = os.path.join(os.path.normpath(folder), "")
    for tensor, filename in weight_map.items():
        if not isinstance(filename, str) or os.path.isabs(filename):
            raise CheckpointError(
                f"the shard {filename!r} is not a relative file name", file=str(index_path), tensor=tensor
            )
        # Judged on the path as written: Hub snapshots are symlinks into a blob store, legitimately.
        shard = os.path.normpath(folder / filename)
        if not shard.startswith(inside):
            raise CheckpointError(
                f"the shard {filename!r} lies outside the checkpoint folder {folder}; refusing to read it",
                file=str(index_path), tensor=tensor,
            )
        shards[tensor] = paths.setdefault(shard, Path(shard))
    return shards


def _sharded(name: str, folder: Path, index_path: Path, index: dict[str, Path], pickled: bool) -> Checkpoint:
    """The checkpoint of an index whose shards are all present."""
    for tensor, shard in index.items():
        if not shard.is_file():
            raise CheckpointNotFoundError(
                f"the index names the shard {shard.name}, which is missing; download the checkpoint again",
                file=str(index_path), tensor=tensor,
            )
    return Checkpoint(name, folder, tuple(sorted(set(index.values()))), index, pickled)


def _local(name: str, folder: Path, allow_pickle: bool) -> Checkpoint:
    if not (folder / CONFIG_NAME).is_file():
        raise CheckpointNotFoundError(
            f"no {CONFIG_NAME} in the folder {folder}; is it a Transformers checkpoint?",
            file=str(folder / CONFIG_NAME),
        )
    for index_name, pickled in ((SAFE_WEIGHTS_INDEX_NAME, False), (PICKLE_WEIGHTS_INDEX_NAME, True)):
        index_path = folder / index_name
        if index_path.is_file() and (not pickled or allow_pickle):
            return _sharded(name, folder, index_path, _read_index(index_path, folder), pickled)
    if (folder / SAFE_WEIGHTS_NAME).is_file():
        return Checkpoint(name, folder, (folder / SAFE_WEIGHTS_NAME,), None)
    if (folder / PICKLE_WEIGHTS_NAME).is_file() or (folder / PICKLE_WEIGHTS_INDEX_NAME).is_file():
        if not allow_pickle:
            raise _pickle_refusal(name)
        return Checkpoint(name, folder, (folder / PICKLE_WEIGHTS_NAME,), None, pickled=True)
    raise CheckpointNotFoundError(
        f"no weights in {folder}: looked for {SAFE_WEIGHTS_NAME} and {SAFE_WEIGHTS_INDEX_NAME}", file=str(folder)
    )


def _hub(name: str, allow_pickle: bool, **download) -> Checkpoint:
    def fetch(filename: str, required: bool = False) -> Path | None:
        try:
            return Path(hf_hub_download(name, filename, **download))
        except LocalEntryNotFoundError as error:
            if required:
                raise CheckpointNotFoundError(
                    f"{filename} of {name!r} is not in the Hugging Face cache and downloads are off "
                    "(HF_HUB_OFFLINE=1 or local_files_only=True): download it once online, or pass a local folder",
                    file=filename,
                ) from error
            return None
        except EntryNotFoundError as error:
            if required:
                raise CheckpointNotFoundError(f"the repository {name!r} has no {filename}", file=filename) from error
            return None

    config = fetch(CONFIG_NAME, required=True)
    folder = config.parent
    fetch(GENERATION_CONFIG_NAME)
    if fetch(NEURON_GENERATION_NAME) is not None:
        snapshot_download(name, allow_patterns=[f"{NEURON_COMPILED_DIR}/*"], **download)
    candidates = [(SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, False)]
    if allow_pickle:
        candidates.append((PICKLE_WEIGHTS_INDEX_NAME, PICKLE_WEIGHTS_NAME, True))
    for index_name, single_name, pickled in candidates:
        index_path = fetch(index_name)
        if index_path is not None:
            index = _read_index(index_path, folder)
            for shard in sorted({path.relative_to(folder).as_posix() for path in index.values()}):
                fetch(shard, required=True)
            return _sharded(name, folder, index_path, index, pickled)
        single = fetch(single_name)
        if single is not None:
            return Checkpoint(name, folder, (single,), None, pickled)
    if not allow_pickle:
        raise CheckpointNotFoundError(
            f"no safetensors weights found for {name!r} ({SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}). If the "
            f"repository has only {PICKLE_WEIGHTS_NAME}, see allow_pickle=True "
            "(pickled weights are refused by default)."
        )
    raise CheckpointNotFoundError(f"no weights found for {name!r}")


def resolve_checkpoint(
    name_or_path: str | os.PathLike[str],
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool = False,
    allow_pickle: bool = False,
) -> Checkpoint:
    """Finds (downloading when needed) the config and weight files of a checkpoint."""
    name = os.fspath(name_or_path)
    if os.path.isdir(name):
        return _local(name, Path(os.path.normpath(os.path.abspath(name))), allow_pickle)
    try:
        return _hub(
            name, allow_pickle, revision=revision, token=token, cache_dir=cache_dir, local_files_only=local_files_only
        )
    except HFValidationError as error:
        raise CheckpointNotFoundError(
            f"{name!r} is neither a local folder nor a Hub repository id ({error})"
        ) from error
