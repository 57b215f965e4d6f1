"""Tensor-parallel loading and decoding: the ~1.24B-parameter Llama of `benchmarks/load.py` split between
1, 2 and 4 ranks (one process per `neuron` device, started with `torch.distributed.run`).

In one run, page cache warm, each case a fresh job (the fastest of `--repeats`):
  library       NeuronAutoModelForCausalLM.from_pretrained(folder, tp_size=N) on `neuron`: each rank reads
                only its slices (shard-on-read in the streaming loader)
  transformers  AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto") on the CPU over gloo (TP 1: a
                plain from_pretrained), the same degree: Transformers' own shard-on-read
per rank: load seconds, peak host memory (peak RSS, file-backed pages included, - RSS before loading -
device memory) and device memory against its share (split tensors / N + replicated ones). Then decode
tokens/s of the library at TP 1 and 2 (greedy, batch 1, compiled graphs, after warm-up), with the
bytes each rank reads per step (its weights) and the machine's read bandwidth (STREAM-style sum of a
1 GiB tensor) on the same number of threads: the per-rank roofline.

    python benchmarks/tensor_parallel.py [--workdir DIR] [--threads 1] [--dtype bfloat16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from load import _rss, header_largest, make_checkpoint, set_page_cache

DEGREES = (1, 2, 4)
DECODE_DEGREES = (1, 2)
NEW_TOKENS = 16


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_rank(mode: str, folder: Path, dtype_name: str, threads: int, out: Path) -> None:
    """One rank of one case: loads (and, for `decode`, generates); writes `out/rank<r>.json`."""
    os.environ.setdefault("OPTIMUM_NEURON_TORCH_FALLBACK", "silent")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(threads)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    dtype = getattr(torch, dtype_name)
    from transformers import AutoModelForCausalLM  # (imports and device activation before the clock starts)

    if mode != "transformers":
        import optimum_neuron_torch as ont
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak RSS to the current RSS
    baseline, _ = _rss()
    start = time.perf_counter()
    if mode == "transformers":
        parallel = {"tp_plan": "auto"} if world > 1 else {}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **parallel)
        device_bytes = 0  # on the CPU: the model is the process's memory
    else:
        model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder, dtype=dtype, tp_size=world)
        device_bytes = torch.neuron.memory_allocated()
    seconds = time.perf_counter() - start
    _, peak = _rss()
    result = {"seconds": seconds, "peak_host_extra": peak - baseline - device_bytes, "device_bytes": device_bytes,
              "share_bytes": _share(model, world)}
    if mode == "decode":
        ids = torch.full((1, 16), 100, dtype=torch.long, device=model.device)
        settings = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        model.generate(ids, **settings)  # warm-up: compiles (or loads) the graphs
        short = dict(settings, max_new_tokens=2, min_new_tokens=2)
        start = time.perf_counter()
        model.generate(ids, **short)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, **settings)
        result["tokens_per_second"] = (NEW_TOKENS - 2) / (time.perf_counter() - start - prefill)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def _share(model, world: int) -> int:
    """Bytes a rank should hold: split tensors / world + replicated ones (each tensor once)."""
    from torch.distributed.tensor import DTensor

    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return int(sum(t.numel() * t.element_size() / (world if isinstance(t, DTensor) else 1)
                   for t in tensors.values()))


def read_bandwidth(threads: int) -> float:
    """GB/s of a plain read of a 1 GiB float32 tensor (`sum`), best of 5, on `threads` threads."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(2**28)
    data.sum()
    best = min(_timed(data.sum) for _ in range(5))
    return data.numel() * 4 / best / 1e9


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def run_job(mode: str, world: int, folder: Path, dtype_name: str, threads: int, workdir: Path) -> list[dict]:
    out = workdir / f"{mode}-{world}"
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("rank*.json"):
        stale.unlink()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if mode == "transformers":
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # the plain CPU: the reference device stays unloaded
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               f"--master-port={_free_port()}", __file__, "--workdir", str(workdir), "--threads", str(threads),
               "--dtype", dtype_name, "--case", mode, "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True, env=env)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/optimum-neuron-torch-load-benchmark"))
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2, help="load jobs per case; the fastest is reported")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = args.workdir / "llama-1b-bf16"
    if args.case:
        run_rank(args.case, folder, args.dtype, args.threads, args.out)
        return

    make_checkpoint(folder)
    files = sorted(folder.glob("*.safetensors"))
    largest = max(header_largest(path) for path in files)
    bound = largest + (256 << 20)
    print(f"checkpoint: {folder} ({sum(p.stat().st_size for p in files) / 2**30:.2f} GiB); load as {args.dtype}; "
          f"{args.threads} thread(s) per rank on {os.cpu_count()} cores; page cache warm")
    print(f"single-device bound on peak host memory: largest tensor + 256 MiB = {bound / 2**20:.0f} MiB\n")
    print("| TP | library load s (slowest rank) | transformers load s | library peak host MiB (max rank) | "
          "transformers peak host MiB | library device MiB / rank | its share MiB | device / share |")
    print("|---|---|---|---|---|---|---|---|")
    loads = {}
    for world in DEGREES:
        set_page_cache(folder, warm=True)
        ours = min((run_job("library", world, folder, args.dtype, args.threads, args.workdir)
                    for _ in range(args.repeats)), key=lambda ranks: max(r["seconds"] for r in ranks))
        theirs = min((run_job("transformers", world, folder, args.dtype, args.threads, args.workdir)
                      for _ in range(args.repeats)), key=lambda ranks: max(r["seconds"] for r in ranks))
        loads[world] = max(r["seconds"] for r in ours)
        device, share = max(r["device_bytes"] for r in ours), max(r["share_bytes"] for r in ours)
        print(f"| {world} | {loads[world]:.2f} | {max(r['seconds'] for r in theirs):.2f} | "
              f"{max(r['peak_host_extra'] for r in ours) / 2**20:.0f} | "
              f"{max(r['peak_host_extra'] for r in theirs) / 2**20:.0f} | {device / 2**20:.0f} | "
              f"{share / 2**20:.0f} | {device / share:.3f} |", flush=True)
    print(f"\nTP-2 load time / TP-1: {loads[2] / loads[1]:.2f}x; TP-4 / TP-1: {loads[4] / loads[1]:.2f}x\n")

    bandwidth = read_bandwidth(args.threads)
    print(f"read bandwidth, {args.threads} thread(s): {bandwidth:.1f} GB/s (one rank's; the ranks share the host's)")
    print("| TP | tokens/s | bytes read per step per rank (weights) MB | per-rank roofline tokens/s | of roofline |")
    print("|---|---|---|---|---|")
    for world in DECODE_DEGREES:
        ranks = run_job("decode", world, folder, args.dtype, args.threads, args.workdir)
        speed = min(r["tokens_per_second"] for r in ranks)
        step_bytes = max(r["device_bytes"] for r in ranks)
        roofline = bandwidth * 1e9 / step_bytes
        print(f"| {world} | {speed:.2f} | {step_bytes / 1e6:.0f} | {roofline:.2f} | {speed / roofline:.0%} |",
              flush=True)


if __name__ == "__main__":
    main()
