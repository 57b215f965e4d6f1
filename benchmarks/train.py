#!/usr/bin/env python
"""Training speed: Transformers' training step on the CPU against the same step on `neuron`, eager
and compiled (`torch.compile(backend="neuron")`), in one run, same model, batch and threads.

Each variant runs in its own process with the same thread count: a model from a config or the
embedded SmolLM2-135M-Instruct (`--model smollm2`), full fine-tuning in float32 with AdamW, batches of
`--batch` sequences of `--sequence` tokens (fixed shapes, as `BucketingDataCollator` gives them), the
loss on every token. A step is forward, backward, optimizer step and zero_grad, timed to the loss on
the host (`.item()`); tokens/s = batch * sequence / median step time over `--steps` steps after
`--warmup` (the compiled variant's first step compiles, reported apart). The three variants start
from the same weights and data, so their losses are compared too.

The physical limit is measured in the same run and threads: the machine's float32 matmul rate
(the best of 5 products of 2048x2048 matrices), and the roofline of a training step, 6 * weights *
tokens floating-point operations (2 forward, 4 backward; the weights of the linear layers, the
output layer included: the input embedding is a lookup) at that rate (attention, the other
element-wise work and the optimizer not counted, so the true ceiling is lower); and the time of the
step's linear-layer matmuls alone at their own shapes (forward, input and weight gradients, best of
3): what this BLAS needs at least, whatever a compiler fuses around it.

Usage:
    python benchmarks/train.py [--model small|smollm2] [--threads 2] [--batch 4] [--sequence 128] [--steps 5]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = {
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=8),
}
EMBEDDED = "smollm2"
VARIANTS = ("cpu eager", "neuron eager", "neuron compiled")


def child(variant: str, folder: str, options: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(options.threads)
    on_neuron = variant.startswith("neuron")
    if on_neuron:
        from optimum_neuron_torch import NeuronAutoModelForCausalLM

        model = NeuronAutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    device = "neuron" if on_neuron else "cpu"
    model.train()
    step_model = torch.compile(model, backend="neuron") if variant == "neuron compiled" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    batches = [torch.randint(4, vocab, (options.batch, options.sequence), generator=generator).to(device)
               for _ in range(options.warmup + options.steps)]
    times, losses = [], []
    for ids in batches:
        start = time.perf_counter()
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    step = statistics.median(times[options.warmup:])
    return {"variant": variant, "step_s": step, "first_step_s": times[0],
            "tokens_per_s": options.batch * options.sequence / step, "losses": losses,
            "parameters": sum(p.numel() for p in model.parameters()),
            # the weights a token is multiplied by (the input embedding is a lookup; a tied one is the output layer)
            "matmul_parameters": sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)),
            "linear_shapes": [list(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]}


def matmul_flops(threads: int) -> float:
    """The machine's float32 matmul rate (FLOP/s): the best of 5 products of 2048x2048 matrices."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    return 2 * 2048**3 / best


def linear_matmuls_seconds(shapes: list[list[int]], tokens: int, threads: int) -> float:
    """The time of a training step's linear-layer matmuls alone, at their own shapes: for each
    weight [out, in], the forward product and the two of the backward (input and weight gradients),
    best of 3. No training step on this BLAS can take less."""
    import torch

    torch.set_num_threads(threads)
    total = 0.0
    for out_features, in_features in shapes:
        x, weight, grad = torch.randn(tokens, in_features), torch.randn(out_features, in_features), \
            torch.randn(tokens, out_features)
        for left, right in ((x, weight.T), (grad, weight), (grad.T, x)):
            left @ right
            total += min(_timed(functools.partial(torch.matmul, left, right)) for _ in range(3))
    return total


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=(*MODELS, EMBEDDED))
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        print(json.dumps(child(options.child, options.folder, options)))
        return

    with tempfile.TemporaryDirectory() as scratch:
        folder = _model_folder(options.model, scratch)
        results = []
        for variant in options.variants.split(","):
            command = [sys.executable, __file__, "--child", variant, "--folder", folder,
                       *(f"--{name}={getattr(options, name)}" for name in ("threads", "batch", "sequence", "steps",
                                                                           "warmup"))]
            env = {**os.environ, "OMP_NUM_THREADS": str(options.threads)}
            output = subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout
            results.append(json.loads(output.strip().splitlines()[-1]))
            print(f"{variant}: {results[-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    flops = matmul_flops(options.threads)
    parameters, matmul_parameters = results[0]["parameters"], results[0]["matmul_parameters"]
    roofline = flops / (6 * matmul_parameters)
    baseline = next(r for r in results if r["variant"] == "cpu eager")
    print(f"\nmodel {options.model} ({parameters / 1e6:.1f}M parameters), float32, batch {options.batch} x "
          f"{options.sequence} tokens, {options.threads} threads, AdamW")
    print(f"{'variant':<18}{'tokens/s':>10}{'step ms':>10}{'first step s':>14}{'x CPU eager':>13}{'of roofline':>13}")
    for result in results:
        print(f"{result['variant']:<18}{result['tokens_per_s']:>10.1f}{result['step_s'] * 1e3:>10.0f}"
              f"{result['first_step_s']:>14.1f}{result['tokens_per_s'] / baseline['tokens_per_s']:>13.2f}"
              f"{result['tokens_per_s'] / roofline:>13.0%}")
    print(f"roofline: {flops / 1e9:.0f} GFLOP/s float32 matmul -> {roofline:.0f} tokens/s (6 x the "
          f"{matmul_parameters / 1e6:.1f}M weights of the linear layers per token)")
    matmuls = linear_matmuls_seconds(results[0]["linear_shapes"], options.batch * options.sequence, options.threads)
    limit = options.batch * options.sequence / matmuls
    print(f"the step's linear-layer matmuls alone, at their shapes: {matmuls * 1e3:.0f} ms -> at most {limit:.0f} "
          f"tokens/s, {limit / baseline['tokens_per_s']:.2f}x CPU eager")
    for result in results[1:]:
        difference = max(abs(a - b) for a, b in zip(result["losses"], baseline["losses"], strict=True))
        print(f"{result['variant']}: largest loss difference from CPU eager over {len(result['losses'])} steps: "
              f"{difference:.2e}")


def _model_folder(name: str, scratch: str) -> str:
    if name == EMBEDDED:
        import optimum_neuron_torch

        return str(optimum_neuron_torch.default_model_path())
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = os.path.join(scratch, name)
    LlamaForCausalLM(LlamaConfig(**MODELS[name])).save_pretrained(folder)
    return folder


if __name__ == "__main__":
    main()
