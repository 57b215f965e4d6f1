"""Tensor parallelism: one model split between several `neuron` devices, one process each.

Run it with torch's launcher, one process per device:

    torchrun --nproc-per-node 3 examples/tensor_parallel.py

Every rank loads the model with `tp_size` = the number of processes: Transformers' own tensor-parallel
plan splits its attention and MLP layers between the ranks, and each rank reads from the safetensors
files only the slices it keeps. Generation then runs on the compiled graphs, with the all-reduces
inside them, on every rank. Rank 0 prints the answer, each rank's device memory, and whether the
tokens equal those of the whole model on the CPU. The default model, SmolLM2-135M-Instruct, has 9
attention heads and 3 key-value heads, so it splits between 3 ranks (not 2 or 4: a head cannot be
split); pass `--model` for another. The same script runs unchanged on a Trainium instance.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

import optimum_neuron_torch
from optimum_neuron_torch import NeuronAutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hub id or a local folder (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model_path = args.model or optimum_neuron_torch.default_model_path()
    model = NeuronAutoModelForCausalLM.from_pretrained(model_path, tp_size=world_size)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    messages = [{"role": "user", "content": args.prompt}]
    inputs = (tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True) if tokenizer.chat_template
              else tokenizer(args.prompt, return_tensors="pt"))
    tokens = model.generate(**{name: value.to(model.device) for name, value in inputs.items()},
                            max_new_tokens=args.new_tokens, do_sample=False).cpu()

    memory = [None] * world_size
    dist.all_gather_object(memory, torch.neuron.memory_allocated())
    verdict = [None]
    if dist.get_rank() == 0:
        answer = tokens[0, inputs["input_ids"].shape[1]:]
        print(f"split between {world_size} ranks: {tokenizer.decode(answer, skip_special_tokens=True)!r}")
        print("device memory per rank: " + ", ".join(f"{m / 2**20:.2f} MiB" for m in memory))
        expected = AutoModelForCausalLM.from_pretrained(model_path).generate(
            **inputs, max_new_tokens=args.new_tokens, do_sample=False)
        verdict[0] = torch.equal(tokens, expected)
        print(f"same tokens as the whole model on the CPU: {verdict[0]}")
    # Every rank learns rank 0's verdict and exits with it: the ranks leave together, and the job's
    # exit status is the same whichever rank the launcher reports.
    dist.broadcast_object_list(verdict, src=0)
    dist.destroy_process_group()
    if not verdict[0]:
        raise SystemExit("the split model produced different tokens than the CPU")


if __name__ == "__main__":
    main()
