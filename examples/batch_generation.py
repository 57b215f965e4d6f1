"""Batch generation: several prompts of different lengths answered by one `generate()` call.

The tokenizer left-pads the prompts to the longest one; compiled generation then pads the batch to a
batch bucket and the prompts to a prompt bucket, and masks all the padding, so every answer equals
the one the prompt gets on its own. The script shows the buckets chosen and checks that equality.
It runs unchanged on a Trainium instance with TorchNeuron installed.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer

import optimum_neuron_torch
from optimum_neuron_torch import NeuronAutoModelForCausalLM

PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "In one sentence, why is the sky blue during the day and red at sunset?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hub id or a local folder (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", nargs="+", default=PROMPTS)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="auto", help="the dtype to load the weights in (default: the checkpoint's)")
    args = parser.parse_args()

    model_path = args.model or optimum_neuron_torch.default_model_path()
    model = NeuronAutoModelForCausalLM.from_pretrained(model_path, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           tokenize=False)
             for prompt in args.prompts]
    batch = tokenizer(chats, padding=True, return_tensors="pt", add_special_tokens=False)

    buckets = model.neuron_generation.buckets
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    padded, _ = buckets.prompt_shape_for(batch["input_ids"].shape[1])
    print(f"{len(chats)} prompts of {lengths} tokens -> batch bucket {buckets.batch_size_for(len(chats))}, "
          f"prompt bucket {padded} (buckets: batch {buckets.batch_sizes}, prompt {buckets.prompt_buckets})")

    def generate(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = model.generate(**{name: value.to("neuron") for name, value in inputs.items()},
                                max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        return tokens[:, inputs["input_ids"].shape[1]:].cpu()

    answers = generate(batch)
    same = True
    for chat, prompt, answer in zip(chats, args.prompts, answers, strict=True):
        alone = generate(tokenizer([chat], return_tensors="pt", add_special_tokens=False))[0]
        same &= torch.equal(answer[: len(alone)], alone) and bool(
            (answer[len(alone):] == tokenizer.pad_token_id).all())
        print(f"{prompt!r} -> {tokenizer.decode(answer, skip_special_tokens=True)!r}")
    print(f"same answers as one prompt at a time: {same}")
    if not same:
        raise SystemExit("batched generation produced different tokens than one prompt at a time")


if __name__ == "__main__":
    main()
