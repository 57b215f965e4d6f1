"""Quickstart: a Transformers model on the `neuron` device.

Builds a small Llama from a config (no download), moves it to `neuron` with the one-line change
`.to("neuron")`, generates greedily, checks the tokens against the CPU, and reports which ops
fell back to the CPU (ops TorchNeuron does not run natively). The same script runs unchanged on
a Trainium instance with TorchNeuron installed.
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import optimum_neuron_torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()

    print(f"neuron backend: {optimum_neuron_torch.backend_info()}")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cpu_model = LlamaForCausalLM(config).eval()
    model = copy.deepcopy(cpu_model).to("neuron")  # the one-line change

    prompt = torch.randint(3, config.vocab_size, (1, 8))
    optimum_neuron_torch.clear_op_tracking()
    tokens = model.generate(prompt.to("neuron"), max_new_tokens=args.new_tokens, do_sample=False)
    print(f"generated on {tokens.device}: {tokens[0, prompt.shape[1]:].tolist()}")

    expected = cpu_model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
    same = torch.equal(tokens.cpu(), expected)
    print(f"same tokens as on the CPU: {same}")
    print(f"ops that fell back to the CPU: {', '.join(optimum_neuron_torch.fallback_ops()) or 'none'}")
    print(f"device memory in use: {torch.neuron.memory_allocated() / 2**20:.1f} MiB")
    if not same:
        raise SystemExit("the neuron device produced different tokens than the CPU")


if __name__ == "__main__":
    main()
