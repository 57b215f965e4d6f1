#!/usr/bin/env python
"""The generation engine's compiled decode steps: grouped key/value heads read in place, against
Transformers' SDPA attention repeating them, and the physical limit, in one run.

For the default model (SmolLM2-135M-Instruct: 9 query heads over 3 key/value heads), float32, 8 slots
and a cache of 2048 positions, this times one greedy decode step of the engine (`SlotSteps.run`: host
inputs in, chosen tokens out) at batch 1 and 8, attending over contexts of 128 and 2048 positions:
- `packed`: the engine's attention (`generation/attention.py`: each key/value head read once by the
  query heads of its group);
- `repeat_kv`: the same step with the model's own SDPA attention, which copies each key/value head
  for its query heads before attending (Transformers does, with a mask, on a device it does not know);
- the limit: the bytes a step must read (the weights, and `batch x context` positions of keys and
  values in every layer) at the read bandwidth measured in the same run (`x.sum()` of 1 GiB).

It also times a prefill chunk of 64 prompt tokens (the engine's step for a piece of a long prompt,
with `--prompt-buckets 16,64`) at the same two contexts: the prompt tokens a second the machine
prefills, which bounds a server whose requests bring long prompts (see `benchmarks/RESULTS.md`).

Both variants run in one process, alternating, best of 5 steps in each of 3 rounds (the CPU of a VM
is noisy from one process to the next). Their graphs are compiled once (cold: about a minute each).

Usage:
    python benchmarks/engine_steps.py [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from generate import bytes_per_step, read_bandwidth

CONTEXTS = (128, 2048)
BATCHES = (1, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import optimum_neuron_torch.generation.slots as slots
    from optimum_neuron_torch import NeuronAutoModelForCausalLM
    from optimum_neuron_torch.generation import Buckets
    from optimum_neuron_torch.generation.requests import SamplingSettings
    from optimum_neuron_torch.loading.default_model import default_model_path

    bandwidth = read_bandwidth(args.threads)
    folder = default_model_path()
    model = NeuronAutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    steps = slots.SlotSteps(model, Buckets.for_slots(model.config, 8, 2048))
    variants = {"packed": slots.packed_attention, "repeat_kv": lambda model: contextlib.nullcontext()}
    greedy = SamplingSettings().row()
    best: dict[tuple[int, int | str, str], float] = {}  # (context, batch or "chunk", variant): seconds
    try:
        with steps.compiling():
            for _ in range(args.rounds):
                for context in CONTEXTS:
                    for batch in BATCHES:
                        for name, attention in variants.items():
                            slots.packed_attention = attention  # (what `SlotSteps.run` enters around a step)
                            inputs = ([[5]] * batch, [[context - 2]] * batch, 0, context, [0.5] * batch,
                                      [greedy] * batch, None)
                            steps.run(*inputs)
                            key = (context, batch, name)
                            best[key] = min([best.get(key, float("inf"))] +
                                            [_timed(steps.run, *inputs) for _ in range(5)])
                for context in CONTEXTS:  # (a prefill piece into slot 0; its last token chooses the first new one)
                    for name, attention in variants.items():
                        slots.packed_attention = attention
                        inputs = ([list(range(5, 69))], [list(range(context - 64, context))], 63, context, [0.5],
                                  [greedy], 0)
                        steps.run(*inputs)
                        key = (context, "chunk", name)
                        best[key] = min([best.get(key, float("inf"))] +
                                        [_timed(steps.run, *inputs) for _ in range(3)])
    finally:
        slots.packed_attention = variants["packed"]

    weights = bytes_per_step(folder, "float32", 1, 0)[0]
    print(f"read bandwidth {bandwidth:.1f} GB/s ({args.threads} threads); weights {weights / 1e6:.0f} MB")
    print("| context | batch | packed (ms) | repeat_kv (ms) | repeat_kv / packed | limit (ms) | packed / limit |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for context in CONTEXTS:
        for batch in BATCHES:
            packed, repeated = best[(context, batch, "packed")], best[(context, batch, "repeat_kv")]
            limit = sum(bytes_per_step(folder, "float32", batch, context)) / (bandwidth * 1e9)
            print(f"| {context} | {batch} | {packed * 1e3:.1f} | {repeated * 1e3:.1f} | {repeated / packed:.2f}x "
                  f"| {limit * 1e3:.1f} | {packed / limit:.2f}x |")

    for context in CONTEXTS:
        packed, repeated = best[(context, "chunk", "packed")], best[(context, "chunk", "repeat_kv")]
        print(f"prefill chunk of 64 tokens, context {context}: packed {packed * 1e3:.1f} ms ({64 / packed:.0f} prompt "
              f"tokens/s), repeat_kv {repeated * 1e3:.1f} ms")


def _timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
