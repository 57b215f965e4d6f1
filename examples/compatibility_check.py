"""Compatibility check: what a model would hit on TorchNeuron, before renting a Trn instance.

Runs `optimum_neuron_torch.check` on `--model` (a Hub id or a local folder) or, by default, on a
tiny Llama 4 built from a config (random weights, no download): its rotary embedding computes with
complex tensors, which TorchNeuron lacks, so the report shows the `complex_rope` patch that fixes
it and what the model hit without it. Prints the report as text, JSON or Markdown (`--format`).
It runs unchanged on a Trainium instance with TorchNeuron installed.
"""

from __future__ import annotations

import argparse

from transformers import Llama4ForCausalLM, Llama4TextConfig

import optimum_neuron_torch


def tiny_llama4() -> Llama4ForCausalLM:
    """A two-layer Llama 4 text model with random weights."""
    config = Llama4TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              num_local_experts=4, max_position_embeddings=64)
    return Llama4ForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hub id or a local folder (default: a tiny Llama 4 built from a config)")
    parser.add_argument("--format", choices=("text", "json", "markdown"), default="text")
    parser.add_argument("--no-compile", action="store_true", help="check the eager run only (faster)")
    args = parser.parse_args()

    report = optimum_neuron_torch.check(args.model or tiny_llama4(), compile=not args.no_compile)
    print(report.render(args.format))


if __name__ == "__main__":
    main()
