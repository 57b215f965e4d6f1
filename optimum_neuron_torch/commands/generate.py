"""`optimum-cli neuron-torch generate [PROMPT]`: text generation on the device, streamed to stdout.

stdout holds the generated text only (the prompt is not repeated); progress bars, warnings and
errors go to stderr, so that the answer can be piped on.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoTokenizer, BatchEncoding, PreTrainedTokenizerBase, TextStreamer

from ..errors import ConfigurationError
from ..loading import default_model_path
from .launch import is_first_rank
from .models import load_generative_model


def read_prompt(prompt: str | None) -> str:
    """The prompt given, else what stdin holds, without surrounding whitespace."""
    if prompt is None:
        if sys.stdin.isatty():
            raise ConfigurationError("no prompt: give it as an argument, or pipe it on stdin")
        prompt = sys.stdin.read()
    prompt = prompt.strip()
    if not prompt:
        raise ConfigurationError("the prompt is empty: give some text to continue")
    return prompt


def prompt_inputs(tokenizer: PreTrainedTokenizerBase, prompt: str, chat_template: bool = True,
                  system: str | None = None) -> BatchEncoding:
    """The model inputs for `prompt`: as a user message (after `system`, when given) through the
    tokenizer's chat template when it has one and `chat_template`, else the plain text."""
    if chat_template and tokenizer.chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    if system:
        raise ConfigurationError("--system needs a chat template: this tokenizer has none, "
                                 "or --no-chat-template was given")
    return tokenizer(prompt, return_tensors="pt")


def generate(model_id: str | None, prompt: str | None, *, max_new_tokens: int = 256, do_sample: bool = False,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, chat_template: bool = True, system: str | None = None,
             tp_size: int = 1, dtype: str | None = None) -> None:
    """Streams the answer of `model_id` (default: the library's default model) to `prompt` (default:
    stdin) on stdout. Decoding is greedy unless `do_sample`; the sampling settings left at None
    keep the model's generation config. With `tp_size` above 1 this process is one rank of a job
    of `tp_size` (see `launch`): every rank generates, rank 0 writes. `dtype`: the weights' (None: the
    checkpoint's)."""
    sampling = {name: value for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
                if value is not None}
    if sampling and not do_sample:
        raise ConfigurationError(f"--{'/--'.join(name.replace('_', '-') for name in sampling)} only apply to "
                                 "sampling: add --do-sample")
    text = read_prompt(prompt)
    if model_id is None:
        model_id = str(default_model_path())
    model = load_generative_model(model_id, tp_size, dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    inputs = prompt_inputs(tokenizer, text, chat_template, system).to(model.device)
    if seed is not None:
        torch.manual_seed(seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if is_first_rank() else None
    model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=do_sample, streamer=streamer, **sampling)
