"""Loading benchmark: a ~1B-parameter Llama checkpoint (bf16, ~500 MB shards) onto `neuron`.

In one run, each case in a fresh process, page cache warm and evicted (posix_fadvise DONTNEED):
  raw           read the same files' bytes into a reused buffer (the bandwidth limit)
  transformers  AutoModelForCausalLM.from_pretrained(..., device_map="neuron")
  library       NeuronAutoModelForCausalLM.from_pretrained(...)
  touch         allocate device tensors of the model's size and write them once: the cost of the
                fresh destination memory alone, which every load pays and the raw read does not
each until every weight is resident on the device, without a cast (bf16) and with a bf16->fp32
cast. Peak host memory = peak RSS (file-backed pages included) - the process's RSS before
loading - device memory (`torch.neuron.memory_allocated()`; device memory is host memory on the
reference device).

    python benchmarks/load.py [--workdir DIR] [--repeats 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SHARD_SIZE = "500MB"
MODES = ("raw", "touch", "transformers", "library")
CONFIG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
              num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=True)


def make_checkpoint(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "model.safetensors.index.json").is_file():
        return
    print(f"writing the checkpoint to {folder} ...", flush=True)
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG, dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.02)
    model.tie_weights()  # to_empty() gave the tied weights separate storage
    model = model.to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=SHARD_SIZE)


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def set_page_cache(folder: Path, warm: bool) -> None:
    for path in _files(folder):
        with open(path, "rb") as file:
            if warm:
                while file.read(64 << 20):
                    pass
            else:
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _rss() -> tuple[int, int]:
    """(current RSS, peak RSS) in bytes, file-backed pages included."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def run_case(mode: str, folder: Path, dtype_name: str, threads: int) -> dict:
    """One measurement, in this (fresh) process."""
    os.environ.setdefault("OPTIMUM_NEURON_TORCH_FALLBACK", "silent")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import optimum_neuron_torch as ont

    hf_logging.set_verbosity_error()
    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak RSS to the current RSS
    baseline, _ = _rss()
    start = time.perf_counter()
    if mode == "raw":
        buffer = bytearray(64 << 20)
        view = memoryview(buffer)
        for path in _files(folder):
            with open(path, "rb", buffering=0) as file:
                while file.readinto(view):
                    pass
        device_bytes = 0
    elif mode == "touch":
        itemsize = torch.empty(0, dtype=dtype).element_size()
        total = sum(int(torch.Size(shape).numel()) for shape in tensor_shapes(folder)) * itemsize
        tensors = [torch.empty(total // 8, dtype=torch.uint8, device="neuron").fill_(1) for _ in range(8)]
        device_bytes = torch.neuron.memory_allocated()
        assert device_bytes >= sum(t.numel() for t in tensors)  # still held while the peak is read
    else:
        if mode == "transformers":
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="neuron")
        else:
            model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        assert all(p.device.type == "neuron" and p.dtype == dtype for p in model.parameters())
        device_bytes = torch.neuron.memory_allocated()
    seconds = time.perf_counter() - start
    _, peak = _rss()
    return {"seconds": seconds, "peak_host_extra": peak - baseline - device_bytes, "device_bytes": device_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/optimum-neuron-torch-load-benchmark"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = args.workdir / "llama-1b-bf16"
    if args.case:
        mode, dtype_name = args.case.split(":")
        print(json.dumps(run_case(mode, folder, dtype_name, args.threads)))
        return

    make_checkpoint(folder)
    total = sum(path.stat().st_size for path in _files(folder))
    largest = max(header_largest(path) for path in _files(folder))
    print(f"checkpoint: {folder} ({total / 2**30:.2f} GiB in {len(_files(folder))} shards, largest tensor "
          f"{largest / 2**20:.0f} MiB); threads {args.threads}; best of {args.repeats} runs, each in a fresh process")
    results = {}
    for cache in ("warm", "cold"):
        for dtype_name in ("bfloat16", "float32"):
            for mode in MODES:
                if mode == "raw" and dtype_name == "float32":
                    results[(cache, dtype_name, mode)] = results[(cache, "bfloat16", mode)]
                    continue
                runs = []
                for _ in range(args.repeats):
                    set_page_cache(folder, warm=cache == "warm")
                    output = subprocess.run(
                        [sys.executable, __file__, "--workdir", str(args.workdir), "--threads", str(args.threads),
                         "--case", f"{mode}:{dtype_name}"], capture_output=True, text=True, check=True,
                    ).stdout
                    runs.append(json.loads(output.strip().splitlines()[-1]))
                results[(cache, dtype_name, mode)] = min(runs, key=lambda r: r["seconds"])
                best = results[(cache, dtype_name, mode)]
                print(f"  {cache:4} {dtype_name:8} {mode:12} {best['seconds']:7.2f} s  "
                      f"peak host extra {best['peak_host_extra'] / 2**20:8.0f} MiB", flush=True)

    print()
    print("| page cache | load as | raw read s | touch s | transformers s | library s | library vs raw "
          "| library vs transformers | transformers peak host MiB | library peak host MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for cache in ("warm", "cold"):
        for dtype_name in ("bfloat16", "float32"):
            raw, touch, hf, ours = (results[(cache, dtype_name, mode)] for mode in MODES)
            print(f"| {cache} | {dtype_name} | {raw['seconds']:.2f} | {touch['seconds']:.2f} | {hf['seconds']:.2f} | "
                  f"{ours['seconds']:.2f} | {raw['seconds'] / ours['seconds']:.2f}x | "
                  f"{hf['seconds'] / ours['seconds']:.2f}x | "
                  f"{hf['peak_host_extra'] / 2**20:.0f} | {ours['peak_host_extra'] / 2**20:.0f} |")
    print(f"\nbound for the library's peak host memory: largest tensor + 256 MiB = "
          f"{(largest + (256 << 20)) / 2**20:.0f} MiB")


def _header(path: Path) -> dict:
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
    header.pop("__metadata__", None)
    return header


def tensor_shapes(folder: Path) -> list[list[int]]:
    return [entry["shape"] for path in _files(folder) for entry in _header(path).values()]


def header_largest(path: Path) -> int:
    return max(end - begin for begin, end in (entry["data_offsets"] for entry in _header(path).values()))


if __name__ == "__main__":
    main()
