"""`optimum-cli neuron-torch compile MODEL`: a model's generation graphs, compiled into the cache
ahead of time (and, with `--save`, into a folder that arrives precompiled)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from transformers import AutoTokenizer

from ..compiler.cache import cache_stats, reset_cache_stats
from ..device import backend_info
from ..loading.checkpoint import NEURON_GENERATION_NAME
from ..settings import compile_cache_dir
from .launch import is_first_rank
from .models import load_generative_model


def compile_model(model_id: str, batch_sizes: tuple[int, ...] | None = None,
                  prompt_buckets: tuple[int, ...] | None = None,
                  max_length: int | None = None, save: str | os.PathLike[str] | None = None,
                  tp_size: int = 1, context_buckets: tuple[int, ...] | None = None, dry_run: bool = False,
                  dtype: str | None = None) -> None:
    """Runs `model.precompile()` for these buckets (None: the model's own), with its progress bar,
    prints how many graphs were compiled and how many were loaded from the cache, and saves the
    model, its compiled graphs and its tokenizer (when it has one) in `save`. With `dry_run`, prints
    the graphs it would compile (the compile bill) and compiles nothing. With `tp_size` above 1 this
    process is one rank of a job of `tp_size` (see `launch`); rank 0 reports. `dtype`: the weights'
    (None: the checkpoint's)."""
    model = load_generative_model(model_id, tp_size, dtype)
    first = is_first_rank()
    # (the engine's decode steps that sample too: what `serve` runs, which then compiles nothing)
    sampling = True if model.neuron_generation.engine_gap is None else None
    if dry_run:
        if first:
            bill = model.compile_bill(batch_sizes, prompt_buckets, max_length, context_buckets, sampling=sampling)
            print("\n".join([f"{type(model).__name__}: the compile bill (--dry-run: nothing compiled)", *bill]))
        return
    reset_cache_stats()
    model.precompile(batch_sizes, prompt_buckets, max_length, show_progress=first, context_buckets=context_buckets,
                     sampling=sampling)
    if save is not None:
        model.save_pretrained(save)  # (under tensor parallelism, every rank: each saves its graphs)
    if not first:
        return
    stats, buckets = cache_stats(), model.neuron_generation.buckets
    print(f"{type(model).__name__}: batch sizes {list(buckets.batch_sizes)}, "
          f"prompt buckets {list(buckets.prompt_buckets)}, "
          f"max length {buckets.max_length}, context buckets {list(buckets.context_buckets)}"
          + (f", split between {tp_size} ranks" if tp_size > 1 else ""))
    neff_cache = backend_info().neff_cache
    if neff_cache is not None:
        print(f"graphs compiled by TorchNeuron, in its NEFF cache: {neff_cache}")
    else:
        print(f"{stats.misses} graphs compiled ({stats.compile_seconds:.1f} s), "
              f"{stats.hits} loaded from the compile cache "
              f"({stats.load_seconds:.1f} s): {compile_cache_dir()}")
    if save is not None:
        try:
            AutoTokenizer.from_pretrained(model_id).save_pretrained(save)
        except (OSError, ValueError) as error:
            reason = str(error).partition("\n")[0]
            print(f"note: saved no tokenizer, none loads: {type(error).__name__}: {reason}", file=sys.stderr)
        spec = json.loads((Path(save) / NEURON_GENERATION_NAME).read_text())
        if "torch_cache_artifacts" in spec:
            counts = ", ".join(f"{count} {kind}" for kind, count in spec["torch_cache_artifacts"].items()) or "none"
            print(f"saved with TorchNeuron's compiled artifacts ({counts}) in {save}")
        else:
            print(f"saved with its {len(spec['graphs'])} compiled graphs in {save}")
