"""Compiling for a model split between ranks, cold: the CPU time the ranks of one job spend compiling.

Each rank of a tensor-parallel job compiles its own graphs (DTensor bakes the rank's vocabulary range
into them), but their C++ kernels are the same but for those constants. In one run, each case a fresh
job with an empty compile cache, `from_pretrained(..., tp_size=N)` then a greedy `generate()` (a
prefill and a decode graph per rank):
  physical limit  1 rank: what N ranks would spend if everything but their own graphs' tracing were shared
  library         N ranks, one compile cache: Inductor builds the kernels in its shared folder, each once
  baseline        N ranks, a compile cache per rank: each rank builds every kernel (the library before)
Printed: wall seconds of the job, CPU seconds of all its processes (user + system), and ratios.

    python benchmarks/rank_compile.py [--ranks 4] [--layers 4] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_rank(folder: Path) -> None:
    """One rank: load split, generate 4 tokens from a 9-token prompt (its graphs compiled cold)."""
    import torch

    import optimum_neuron_torch as ont

    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder, tp_size=int(os.environ["WORLD_SIZE"]))
    ids = torch.arange(4, 13).unsqueeze(0).to("neuron")
    model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)


def make_model(folder: Path, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(folder)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(world: int, folder: Path, cache: Path, per_rank_cache: bool) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every process) of one cold job."""
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "OPTIMUM_NEURON_TORCH_COMPILE_CACHE": str(cache), "OMP_NUM_THREADS": "1",
           "OPTIMUM_NEURON_TORCH_FALLBACK": "silent", "RANK_COMPILE_PER_RANK_CACHE": "1" if per_rank_cache else ""}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               f"--master-port={_free_port()}", __file__, "--rank", str(folder)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--rank", type=Path, default=None, help=argparse.SUPPRESS)  # (a rank of a job)
    args = parser.parse_args()
    if args.rank is not None:
        if os.environ.get("RANK_COMPILE_PER_RANK_CACHE"):  # (before the library reads it)
            cache = Path(os.environ["OPTIMUM_NEURON_TORCH_COMPILE_CACHE"]) / f"rank{os.environ['RANK']}"
            os.environ["OPTIMUM_NEURON_TORCH_COMPILE_CACHE"] = str(cache)
        run_rank(args.rank)
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rank-compile-"))
    folder = workdir / "model"
    if not folder.is_dir():
        make_model(folder, args.layers)
    cases = {"physical limit": (1, False), "library": (args.ranks, False), "baseline": (args.ranks, True)}
    results = {name: run_job(world, folder, workdir / "cache", per_rank) for name, (world, per_rank) in cases.items()}
    print(f"{'case':<15} {'ranks':>5} {'wall s':>8} {'CPU s':>8}")
    for name, (wall, cpu) in results.items():
        print(f"{name:<15} {cases[name][0]:>5} {wall:>8.1f} {cpu:>8.1f}")
    (_, library), (_, baseline), (_, limit) = (results[name] for name in ("library", "baseline", "physical limit"))
    print(json.dumps({"library_cpu_vs_baseline": round(library / baseline, 3),
                      "library_cpu_vs_limit": round(library / limit, 3),
                      "baseline_cpu_vs_limit": round(baseline / limit, 3)}))


if __name__ == "__main__":
    main()
