"""Text generation with streaming: the answer is printed token by token as the `neuron` device
produces it.

Loads the default model (SmolLM2-135M-Instruct) or `--model`, applies its chat template, and
generates through compiled static-shape graphs with a Transformers `TextStreamer`, greedily or, with
`--do-sample`, sampled (`--temperature`, `--top-k`, `--top-p`, reproducible under `--seed`). The
same script runs unchanged on a Trainium instance with TorchNeuron installed.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoTokenizer, TextStreamer

import optimum_neuron_torch
from optimum_neuron_torch import NeuronAutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hub id or a local folder (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", default="Write one sentence about the sea.")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--do-sample", action="store_true", help="sample instead of picking the most likely token")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="seeds the sampling, so a run can be repeated")
    parser.add_argument("--dtype", default="auto", help="the dtype to load the weights in (default: the checkpoint's)")
    args = parser.parse_args()

    model_path = args.model or optimum_neuron_torch.default_model_path()
    model = NeuronAutoModelForCausalLM.from_pretrained(model_path, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)

    torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    tokens = model.generate(**{name: value.to("neuron") for name, value in inputs.items()}, streamer=streamer,
                            max_new_tokens=args.new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p)
    seconds = time.perf_counter() - start
    new_tokens = tokens.shape[1] - inputs["input_ids"].shape[1]
    print(f"[{new_tokens} new tokens in {seconds:.1f} s, the first call loads or compiles the graphs it needs]")


if __name__ == "__main__":
    main()
