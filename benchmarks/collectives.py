"""Collective bandwidth on the `neuron` process group against gloo on CPU tensors, in the same run.

The reference device's `neuron` backend hands gloo zero-copy host views of device tensors: this
measures what that costs. Each rank times all_reduce and all_gather on `neuron` tensors (the default
group, backend `neuron`) and on CPU tensors (a gloo group over the same ranks), sizes 4 KiB to 256 MiB,
blocks of the two interleaved, the median of 7 blocks per size. Bandwidths as nccl-tests reports
them: algbw = bytes / time; busbw =
algbw * 2(n-1)/n for all_reduce (bytes of the tensor), algbw * (n-1)/n for all_gather (bytes of the
gathered output). Target: neuron >= 0.9x gloo on CPU tensors at every size.

    python benchmarks/collectives.py              # starts 2 ranks with torchrun
    python benchmarks/collectives.py --ranks 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from functools import partial

import torch

# gloo on CPU tensors timed twice: how far two runs of the same thing differ (the noise of the
# measurement) is printed next to each ratio.
RUNS = {"cpu": "cpu", "neuron": "neuron", "cpu again": "cpu"}  # run: the device of its tensors
SIZES = [4 << 10 << (2 * step) for step in range(9)]  # 4 KiB, 16 KiB, ..., 256 MiB


def _format_bytes(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size // scale} {unit}"
    return f"{size} B"


def _block(run, iterations: int) -> float:
    """Seconds per call over one block of `iterations` calls, started and ended by a barrier."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    dist.barrier()
    return (time.perf_counter() - start) / iterations


def _compare(runs: dict, iterations: int, rounds: int = 15) -> dict[str, float]:
    """Median seconds per call of each run, their blocks interleaved and their order rotated from
    round to round, so that the machine's drift and the position in a round hit every run alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        _block(run, max(1, iterations // 4))  # warm-up
    names = list(runs)
    for round in range(rounds):
        for name in names[round % len(names):] + names[:round % len(names)]:  # each run in each position
            times[name].append(_block(runs[name], iterations))
    return {name: statistics.median(values) for name, values in times.items()}


def worker(threads: int) -> None:
    import torch.distributed as dist

    import optimum_neuron_torch  # noqa: F401  (registers the `neuron` backend)

    torch.set_num_threads(threads)
    dist.init_process_group()  # `neuron`, the default backend of the neuron device
    gloo = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"cpu": gloo, "neuron": None}
    rows = []
    for size in SIZES:
        numel = size // 4
        iterations = max(2, min(200, (32 << 20) // size))
        tensors = {"neuron": torch.ones(numel, device="neuron"), "cpu": torch.ones(numel)}
        outputs = {"neuron": torch.empty(numel * world, device="neuron"), "cpu": torch.empty(numel * world)}
        reduce = _compare({run: partial(dist.all_reduce, tensors[device], group=groups[device])
                           for run, device in RUNS.items()}, iterations)
        gather = _compare({run: partial(dist.all_gather_into_tensor, outputs[device], tensors[device],
                                        group=groups[device]) for run, device in RUNS.items()}, iterations)
        seconds = {run: (reduce[run], gather[run]) for run in RUNS}
        rows.append((size, seconds))
    if rank == 0:
        factor_reduce, factor_gather = 2 * (world - 1) / world, (world - 1) / world
        print(f"{world} ranks, {threads} torch thread(s) per rank, torch {torch.__version__}")
        print("| size | all_reduce busbw, gloo CPU GB/s | neuron GB/s | ratio | A/A | "
              "all_gather busbw, gloo CPU GB/s | neuron GB/s | ratio | A/A |")
        print("|---|---|---|---|---|---|---|---|---|")
        worst = float("inf")
        for size, seconds in rows:
            busbw = {run: (size / seconds[run][0] / 1e9 * factor_reduce,
                           size * world / seconds[run][1] / 1e9 * factor_gather) for run in RUNS}
            cells = []
            for op in (0, 1):
                ratio = busbw["neuron"][op] / busbw["cpu"][op]
                worst = min(worst, ratio)
                cells.append(f"{busbw['cpu'][op]:.3f} | {busbw['neuron'][op]:.3f} | {ratio:.2f}x | "
                             f"{busbw['cpu again'][op] / busbw['cpu'][op]:.2f}x")
            print(f"| {_format_bytes(size)} | {' | '.join(cells)} |")
        print(f"worst ratio: {worst:.2f}x (target >= 0.90x): {'met' if worst >= 0.9 else 'NOT met'}. "
              "A/A: gloo on CPU tensors against itself, the noise of this measurement.")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.threads)
        return
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ranks}", __file__,
               "--worker", "--threads", str(args.threads)]
    raise SystemExit(subprocess.call(command, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}))


if __name__ == "__main__":
    main()
