"""Compiled generation in `save_pretrained` output: the bucket spec, the compile settings, the
environment the graphs were compiled in (`neuron_generation.json`) and the compiled graphs
themselves (`neuron_compiled/<key>/`, compile-cache entries), so that a model saved precompiled
arrives precompiled."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

from ..compiler.artifact import environment
from ..compiler.cache import CompileCache
from ..loading.checkpoint import NEURON_COMPILED_DIR, NEURON_GENERATION_NAME
from .buckets import Buckets
from .compiled_generation import COMPILE_CONFIG, CompiledGeneration


def save(generation: CompiledGeneration, folder: Path) -> None:
    """Writes the spec and copies the model's compiled graphs from the compile cache into `folder`."""
    cache = CompileCache()
    entries = [entry for entry in map(cache.get, sorted(generation.cache_keys)) if entry is not None]
    spec = {
        "buckets": generation.buckets.to_dict(),
        "compile_config": COMPILE_CONFIG.to_dict(),
        "environment": environment(),
        "graphs": [entry.key for entry in entries],
    }
    (folder / NEURON_GENERATION_NAME).write_text(json.dumps(spec, indent=2) + "\n")
    shutil.rmtree(folder / NEURON_COMPILED_DIR, ignore_errors=True)
    for entry in entries:
        shutil.copytree(entry.path, folder / NEURON_COMPILED_DIR / entry.key)


def restore(folder: Path) -> Buckets | None:
    """The saved buckets, or None; the saved graphs go into the compile cache when they were
    compiled in this environment, else a warning says that they will be compiled again."""
    spec_path = folder / NEURON_GENERATION_NAME
    if not spec_path.is_file():
        return None
    spec = json.loads(spec_path.read_text())
    buckets = Buckets.from_dict(spec["buckets"])
    saved, here = spec.get("environment", {}), environment()
    differences = {name: (saved.get(name), value) for name, value in here.items() if saved.get(name) != value}
    if differences:
        listed = "; ".join(f"{name}: saved {old!r}, here {new!r}" for name, (old, new) in differences.items())
        warnings.warn(
            f"The compiled graphs saved in {folder} were compiled in another environment ({listed}): they will be "
            "compiled again on first use. Call model.precompile() to compile them all now.", stacklevel=3,
        )
        return buckets
    cache = CompileCache()
    for key in spec.get("graphs", []):
        entry_folder = folder / NEURON_COMPILED_DIR / key
        if entry_folder.is_dir():
            cache.add(entry_folder)
    return buckets
