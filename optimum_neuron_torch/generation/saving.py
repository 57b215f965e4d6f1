"""Compiled generation in `save_pretrained` output: the bucket spec, the compile settings, the
environment the graphs were compiled in (`neuron_generation.json`) and the compiled graphs
themselves, so that a model saved precompiled arrives precompiled:
- on the reference device, the model's compile-cache entries (`neuron_compiled/<key>/`; under
  tensor parallelism, every rank's);
- on TorchNeuron, whose own NEFF cache holds the compiled graphs, the process's compiled artifacts
  as torch's MegaCache serializes them (`torch.compiler.save_cache_artifacts()`, which TorchNeuron
  hooks for its NEFFs): `neuron_compiled/torch_cache_artifacts.bin`, given back to
  `torch.compiler.load_cache_artifacts()` on load. It holds every graph compiled in the process
  until then, this model's and any other's (under tensor parallelism, one file per rank).
The spec records the tensor-parallel degree: graphs compiled for another degree are compiled again.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh
from transformers import PreTrainedModel

from .. import object_collectives
from ..compiler.artifact import compile_environment
from ..compiler.cache import CompileCache
from ..device import backend_info
from ..errors import CompileCacheError
from ..loading.checkpoint import NEURON_COMPILED_DIR, NEURON_GENERATION_NAME
from .buckets import Buckets
from .compiling import COMPILE_CONFIG
from .neuron_generation import NeuronGeneration
from .split_model import gather_keys, tensor_parallel_mesh

TORCH_CACHE_ARTIFACTS = "torch_cache_artifacts"


def save(generation: NeuronGeneration, folder: Path) -> None:
    """Writes the spec and the model's compiled graphs into `folder`. Under tensor parallelism
    every rank calls it: each adds its own graphs, and the first rank writes the spec, which
    records the degree (`tp_size`) the graphs were compiled for."""
    mesh = tensor_parallel_mesh(generation.model)
    first = mesh is None or mesh.get_local_rank() == 0
    spec = {
        "buckets": generation.buckets.to_dict(),
        "compile_config": COMPILE_CONFIG.to_dict(),
        "environment": compile_environment(),
        "tp_size": 1 if mesh is None else mesh.size(),
    }
    if first:
        shutil.rmtree(folder / NEURON_COMPILED_DIR, ignore_errors=True)
    if mesh is not None:
        # The folder is emptied before any rank writes into it.
        object_collectives.barrier(mesh.get_group(), "saving compiled graphs")
    if backend_info().compiles_itself:
        spec["torch_cache_artifacts"] = _save_torch_cache_artifacts(folder / _artifacts_file(mesh))
    else:
        cache = CompileCache()
        entries = [entry for entry in map(cache.get, sorted(generation.cache_keys)) if entry is not None]
        for entry in entries:
            shutil.copytree(entry.path, folder / NEURON_COMPILED_DIR / entry.key, dirs_exist_ok=True)
        spec["graphs"] = gather_keys(mesh, {entry.key for entry in entries})
    if first:
        (folder / NEURON_GENERATION_NAME).write_text(json.dumps(spec, indent=2) + "\n")


def _artifacts_file(mesh: DeviceMesh | None) -> str:
    """Where TorchNeuron's compiled artifacts go in a saved folder: one file, or one per rank."""
    rank = "" if mesh is None else f".rank{mesh.get_local_rank()}"
    return f"{NEURON_COMPILED_DIR}/{TORCH_CACHE_ARTIFACTS}{rank}.bin"


def _save_torch_cache_artifacts(path: Path) -> dict[str, int]:
    """TorchNeuron: the process's compiled artifacts through torch's MegaCache; {artifact type: count}."""
    serialized = torch.compiler.save_cache_artifacts()
    if serialized is None:
        warnings.warn(
            f"TorchNeuron recorded no compiled artifacts in this process, so {path.parent.parent} holds no compiled "
            "graphs: they will be compiled on first use. Call model.precompile() before save_pretrained() to include "
            "them.",
            stacklevel=4,
        )
        return {}
    data, info = serialized
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {kind: len(keys) for kind, keys in sorted(info.artifacts.items())}


def restore(folder: Path, model: PreTrainedModel) -> Buckets | None:
    """The saved buckets, or None; the saved graphs go into the compile cache when they were
    compiled in this environment for the model's tensor-parallel degree, else a warning says
    that they will be compiled again."""
    spec_path = folder / NEURON_GENERATION_NAME
    if not spec_path.is_file():
        return None
    spec = json.loads(spec_path.read_text())
    buckets = Buckets.from_dict(spec["buckets"])
    mesh = tensor_parallel_mesh(model)
    saved = {**spec.get("environment", {}), "tp_size": spec.get("tp_size", 1)}
    here = {**compile_environment(), "tp_size": 1 if mesh is None else mesh.size()}
    differences = {name: (saved.get(name), value) for name, value in here.items() if saved.get(name) != value}
    if differences:
        listed = "; ".join(f"{name}: saved {old!r}, here {new!r}" for name, (old, new) in differences.items())
        warnings.warn(
            f"The compiled graphs saved in {folder} were compiled in another environment ({listed}): they will be "
            "compiled again on first use. Call model.precompile() to compile them all now.", stacklevel=3,
        )
        return buckets
    artifacts = folder / _artifacts_file(mesh)
    if artifacts.is_file() and backend_info().compiles_itself:
        torch.compiler.load_cache_artifacts(artifacts.read_bytes())  # TorchNeuron puts the NEFFs in its cache
    cache = CompileCache()
    for key in spec.get("graphs", []):
        entry_folder = folder / NEURON_COMPILED_DIR / key
        if entry_folder.is_dir():
            try:
                cache.add(entry_folder)
            except CompileCacheError as error:  # (that graph is compiled on first use instead)
                warnings.warn(f"{error} It is compiled again on first use.", stacklevel=3)
    return buckets
