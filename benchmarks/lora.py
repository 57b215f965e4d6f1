#!/usr/bin/env python
"""What serving LoRA adapters costs: decode tokens/s of the generation engine on `neuron` without adapters, then
with `--max-loras` slots attached (`generation.lora_adapters`), rows of the model alone and rows of a different
adapter each, in one run.

The default model (SmolLM2-135M-Instruct, float32) and random PEFT adapters of it (rank `--rank`, every linear
layer, as `peft.get_peft_model` makes them, their B matrices random), saved and loaded as a server loads them.
For batch 1 and batch 4 (one engine of 4 slots, 512 positions), greedy, `--new-tokens` each, the engine driven from
the main thread (`complete`): tokens/s over the wall time (the prompts are a few tokens: decode dominates).

The limit: a decode step reads the model's weights and, with adapters attached, every slot's A and B; at batch 1,
bound by those bytes, the ratio with over without is at most model bytes / (model + slots) bytes (printed).

Usage:
    python benchmarks/lora.py [--max-loras 4] [--rank 16] [--new-tokens 96]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import peft
import torch
from transformers import AutoModelForCausalLM

import optimum_neuron_torch as ont
from optimum_neuron_torch.generation.buckets import Buckets
from optimum_neuron_torch.generation.engine import GenerationEngine
from optimum_neuron_torch.generation.lora_adapters import AdapterSlots
from optimum_neuron_torch.generation.requests import Request, SamplingSettings

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapters(folder: str, count: int, rank: int, into: Path) -> list[Path]:
    """`count` random PEFT LoRA adapters of the model in `folder`, saved under `into`."""
    saved = []
    for index in range(count):
        torch.manual_seed(index)
        model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(folder),
                                    peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0.0, 0.01)
        model.save_pretrained(into / f"adapter-{index}")
        saved.append(into / f"adapter-{index}")
    return saved


def tokens_per_second(engine: GenerationEngine, rows: int, new_tokens: int, slots: AdapterSlots | None,
                      names: list[str | None]) -> float:
    """Decode tokens/s of `rows` requests at once (the best of 2 runs), each with its adapter of `names`."""
    best = 0.0
    for _ in range(2):
        requests = []
        for row in range(rows):
            request = Request([1, 2 + row, 3], new_tokens, SamplingSettings(), [], lambda event: None,
                              eos_token_ids=set())
            if names[row] is not None:
                slots.use(names[row], request)
            requests.append(request)
        start = time.perf_counter()
        engine.complete(requests)
        best = max(best, rows * new_tokens / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    args = parser.parse_args()
    folder = str(ont.default_model_path())
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder)
    buckets = Buckets.for_slots(model.config, 4, 512, (16,))
    rates = {}
    engine = GenerationEngine(model, buckets)
    engine.warm_up(show_progress=False, sampling=False)
    for rows in (1, 4):
        rates["without adapters", rows] = tokens_per_second(engine, rows, args.new_tokens, None, [None] * rows)
    saved = adapters(folder, args.max_loras, args.rank, Path(tempfile.mkdtemp()))
    engine = GenerationEngine(model, buckets)
    slots = AdapterSlots(engine, args.max_loras, args.rank)
    for index, path in enumerate(saved):
        slots.load(f"adapter-{index}", path)
    engine.warm_up(show_progress=False, sampling=False)
    names = [f"adapter-{index % args.max_loras}" for index in range(4)]
    for rows in (1, 4):
        rates["adapters attached, rows of the model alone", rows] = tokens_per_second(
            engine, rows, args.new_tokens, slots, [None] * rows)
        rates["a different adapter per row", rows] = tokens_per_second(engine, rows, args.new_tokens, slots,
                                                                       names[:rows])
    model_bytes = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    slot_bytes = sum(module.lora_a.numel() * module.lora_a.element_size() + module.lora_b.numel()
                     * module.lora_b.element_size() for module in slots.modules.values())
    print(f"the default model, float32; {args.max_loras} slots of rank {args.rank} in {len(slots.modules)} layers; "
          f"{args.new_tokens} new tokens per row, greedy")
    for (name, rows), rate in rates.items():
        print(f"batch {rows}, {name}: {rate:.1f} tokens/s, {rate / rates['without adapters', rows]:.2f}x")
    print(f"a step reads {model_bytes / 1e6:.0f} MB of weights and {slot_bytes / 1e6:.1f} MB of adapter slots: at "
          f"batch 1, bound by bytes, the ratio is at most {model_bytes / (model_bytes + slot_bytes):.2f}")


if __name__ == "__main__":
    main()
