#!/usr/bin/env python
"""Start-up cost of the default model (or `--model`) on `neuron`: what a user waits for before the
first token, cold (an empty compile cache) and warm (the cache a previous run filled), in one run.

Each phase runs in a new process of its own (as a user's process meets it: nothing traced or
loaded before it), one after another, and prints its wall seconds, the graphs Dynamo traced, the
programs the backend compiled and those it loaded from the compile cache, and the backend's
compile seconds:
- `precompile cold, layers inline`: `model.precompile(sampling=True)` of the default buckets (the
  graphs `compile` compiles: the generation engine's, its decode steps that sample included) with
  `OPTIMUM_NEURON_TORCH_DISABLE_LAYER_REUSE=1`, every decoder layer inline in every graph (the
  baseline: the library before layer reuse);
- `precompile cold`: the same with one compile per distinct layer (the library);
- `generate warm`: a new process on the cache `precompile cold` filled: `from_pretrained`, then
  `generate()` of a short chat prompt, greedy: seconds to load, to the first token, and the tokens
  (compared with the same prompt through Transformers on the CPU); its compiled functions are
  restored from the cache, not traced (`restored`, see `optimum_neuron_torch/compiler/precompiled.py`);
- `eager first token` (the floor of a warm start): `from_pretrained` and one eager forward of the
  prompt on `neuron`, nothing compiled;
- `serve after precompile`: `optimum-cli neuron-torch serve` on that cache, from launch until `/health`
  answers 200 (the server runs the engine `generate()` runs, on the same buckets, so it finds what
  `precompile` compiled), then a first request's seconds, and the seconds from launch until the
  server has loaded every graph (it loads them while idle); then `serve warm`: again; with
  `--serve-cold`, also on an empty cache.

    python benchmarks/startup.py [--model PATH] [--serve-cold] [--skip-serve] [--skip-inline]
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

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 8
HERE = Path(__file__).resolve()


def phase(name: str, model: str | None) -> dict:
    """Runs phase `name` in this process (the child's side); returns its figures."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    import optimum_neuron_torch as ont
    from optimum_neuron_torch.compiler import cache_stats

    path = model or ont.default_model_path()
    began = time.perf_counter()
    neuron = ont.NeuronAutoModelForCausalLM.from_pretrained(path)
    loaded = time.perf_counter() - began
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    figures: dict = {"load_s": loaded}
    if name.startswith("precompile"):
        neuron.precompile(show_progress=False, sampling=True)
        figures["graphs_planned"] = len(neuron.neuron_generation.graph_plan(sampling=True))
    elif name == "generate warm":
        first: list[float] = []

        class FirstToken(TextStreamer):
            def put(self, value: torch.Tensor) -> None:
                if not first and value.numel() == 1:  # (the prompt comes first, then one token per step)
                    first.append(time.perf_counter())

        called = time.perf_counter()
        tokens = neuron.generate(**{key: value.to("neuron") for key, value in ids.items()}, do_sample=False,
                                 max_new_tokens=NEW_TOKENS, streamer=FirstToken(tokenizer))
        figures["first_token_s"] = first[0] - called
        cpu = AutoModelForCausalLM.from_pretrained(path)
        expected = cpu.generate(**ids, do_sample=False, max_new_tokens=NEW_TOKENS)
        figures["tokens_match_cpu"] = tokens.cpu().tolist() == expected.tolist()
    elif name == "eager first token":
        called = time.perf_counter()
        with torch.no_grad():
            neuron(**{key: value.to("neuron") for key, value in ids.items()}).logits[:, -1].argmax(-1).cpu()
        figures["first_token_s"] = time.perf_counter() - called
    stats = cache_stats()
    figures.update(traced=int(torch._dynamo.utils.counters["stats"]["unique_graphs"]), restored=stats.restored,
                   compiled=stats.misses, loaded=stats.hits, compile_s=stats.compile_seconds)
    return figures


def run_phase(name: str, model: str | None, cache: Path, env: dict[str, str] | None = None) -> dict:
    """Phase `name` in a new process on compile cache `cache`: its figures and wall seconds."""
    from optimum_neuron_torch.settings import COMPILE_CACHE_ENV

    command = [sys.executable, str(HERE), "--phase", name] + (["--model", model] if model else [])
    began = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, COMPILE_CACHE_ENV: str(cache), **(env or {})},
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"phase {name!r} failed:\n{done.stderr[-3000:]}")
    figures = {"wall_s": wall, **json.loads(done.stdout.strip().splitlines()[-1])}
    print(f"  {name}: {figures}", flush=True)  # (as it comes: the table follows the last phase)
    return figures


def serve_ready(model: str | None, cache: Path) -> dict[str, float]:
    """`optimum-cli neuron-torch serve` on `cache`: seconds from launch until `/health` answers 200
    (`ready`), then the seconds of a first chat request (8 tokens, greedy), then the seconds from
    launch until the server has loaded every graph (`/health`'s `graphs_unloaded` is 0)."""
    import httpx

    sys.path.insert(0, str(HERE.parent))
    from serve import free_port, start, stop

    from optimum_neuron_torch.settings import COMPILE_CACHE_ENV

    port = free_port()
    cache.parent.mkdir(parents=True, exist_ok=True)
    os.environ[COMPILE_CACHE_ENV] = str(cache)
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "optimum.commands.optimum_cli", "neuron-torch", "serve", "--port", str(port)]
    launched = time.perf_counter()
    process, ready = start(command + ([model] if model else []), url, cache.parent / "serve.log")
    asked = time.perf_counter()
    httpx.post(url + "/v1/chat/completions", timeout=600, json={
        "model": "SmolLM2-135M-Instruct" if model is None else model, "messages": PROMPT,
        "max_tokens": NEW_TOKENS, "temperature": 0}).raise_for_status()
    first_request = time.perf_counter() - asked
    while httpx.get(url + "/health", timeout=60).json()["graphs_unloaded"]:
        time.sleep(0.2)
    loaded = time.perf_counter() - launched
    stop(process)
    figures = {"ready_s": ready, "first_request_s": first_request, "all_loaded_s": loaded}
    print(f"  serve on {cache}: {figures}", flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder or Hub id (default: the library's default model)")
    parser.add_argument("--serve-cold", action="store_true", help="also time `serve` on an empty cache")
    parser.add_argument("--skip-serve", action="store_true", help="skip every `serve` phase")
    parser.add_argument("--skip-inline", action="store_true", help="skip the layers-inline baseline")
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # (the child's side)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, args.model)))
        return

    import torch

    from optimum_neuron_torch.settings import DISABLE_LAYER_REUSE_ENV

    print(f"model: {args.model or 'default (SmolLM2-135M-Instruct)'}; {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} threads; each phase a new process")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        if not args.skip_inline:
            rows.append(("precompile cold, layers inline",
                         run_phase("precompile cold, layers inline", args.model, root / "inline" / "cache",
                                   {DISABLE_LAYER_REUSE_ENV: "1"})))
        rows.append(("precompile cold", run_phase("precompile cold", args.model, root / "regions" / "cache")))
        rows.append(("generate warm", run_phase("generate warm", args.model, root / "regions" / "cache")))
        rows.append(("eager first token", run_phase("eager first token", args.model, root / "eager" / "cache")))
        serve = {}
        if not args.skip_serve:
            serve["serve after precompile"] = serve_ready(args.model, root / "regions" / "cache")
            serve["serve warm"] = serve_ready(args.model, root / "regions" / "cache")
            if args.serve_cold:
                serve["serve cold"] = serve_ready(args.model, root / "served" / "cache")

    print(f"{'phase':34} {'wall s':>8} {'load s':>7} {'1st tok s':>9} {'traced':>6} {'restored':>8} "
          f"{'compiled':>8} {'loaded':>6} {'compile s':>9}")
    for name, row in rows:
        first = f"{row['first_token_s']:9.2f}" if "first_token_s" in row else f"{'':9}"
        print(f"{name:34} {row['wall_s']:8.1f} {row['load_s']:7.1f} {first} {row['traced']:6d} "
              f"{row['restored']:8d} {row['compiled']:8d} {row['loaded']:6d} {row['compile_s']:9.1f}")
    for name, served in serve.items():
        print(f"{name:34} {served['ready_s']:8.1f}   (launch until /health answers 200; then a first request "
              f"{served['first_request_s']:.1f} s; every graph loaded {served['all_loaded_s']:.1f} s after launch)")
    figures = dict(rows)
    if "precompile cold, layers inline" in figures:
        inline, regions = figures["precompile cold, layers inline"], figures["precompile cold"]
        print(f"cold precompile, layers inline / one compile per layer: {inline['wall_s'] / regions['wall_s']:.2f}x "
              f"wall, {inline['compile_s'] / max(regions['compile_s'], 1e-9):.2f}x backend compile")
    warm, floor = figures["generate warm"], figures["eager first token"]
    print(f"warm first token {warm['first_token_s']:.2f} s (target <= 3 s; tokens equal the CPU's: "
          f"{warm['tokens_match_cpu']}); eager first token, the floor: {floor['first_token_s']:.2f} s "
          f"({warm['first_token_s'] / floor['first_token_s']:.1f}x)")
    if serve:
        print(f"serve after precompile, launch to ready: {serve['serve after precompile']['ready_s']:.1f} s; "
              f"serve warm {serve['serve warm']['ready_s']:.1f} s (target <= 15 s)")


if __name__ == "__main__":
    main()
