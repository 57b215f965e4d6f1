#!/usr/bin/env python
"""Speculative decoding at batch 1: output tokens/s of this library's server with prompt-lookup speculation
(`--speculative-config '{"method": "ngram", ...}'`) against the same server without, in one run.

Each server (`optimum-cli neuron-torch serve`, the default model on `neuron`, one slot, `--max-length 512`)
runs alone, once it has loaded every graph, and gets the same requests one after another (greedy, streamed):

- repetitive text: "Repeat the following text exactly" with a paragraph or a piece of code (the answer copies
  the prompt: what prompt lookup drafts right), `--max-tokens` at most;
- questions (`serve.QUESTIONS`): little to look up, where speculation must cost little.

Measured per workload: decode tokens/s (completion tokens after the first, over the time from the first
chunk of text to the last), the ratio with speculation over without (target >= 1.5 on repetitive text),
whether every answer's text is the same with and without (greedy: it must be), and from `/metrics` the
acceptance rate (drafted tokens taken) and the tokens a verify step gives. The limit, in the same run: a
verify step gives at most `k + 1` tokens and reads the weights once as a decode step does, so the ratio
is at most the tokens per verify step times the decode step's time over the verify step's (printed: the
tokens per verify step measured, and `k + 1`).

Usage:
    python benchmarks/speculative.py [--num-speculative-tokens 4] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve import QUESTIONS, free_port, start, stop

MODEL = "SmolLM2-135M-Instruct"
PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog. The dog wakes up and chases the fox across the field, past the "
    "old barn and into the woods, where they both stop to rest under a tall oak tree.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n",
    "Trainium is a machine learning chip built by AWS. Each chip holds several NeuronCores, and each core runs "
    "the programs the Neuron compiler builds from a model's graphs. A graph of new shapes is a new program.",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def norm(self):\n"
    "        return (self.x ** 2 + self.y ** 2) ** 0.5\n",
]
REPEAT = "Repeat the following text exactly, word for word:\n\n"


def ask(url: str, content: str, max_tokens: int) -> tuple[str, int, float]:
    """One streamed greedy chat request: its text, completion tokens, and seconds from its first chunk of text
    to its last."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text, first, last, tokens = [], None, None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            content = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if content:
                first, last = first or time.perf_counter(), time.perf_counter()
                text.append(content)
    return "".join(text), tokens, last - first


def counts(url: str) -> dict[str, float]:
    """The speculative decoding counts of `/metrics`."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("optimum_neuron_torch:spec_decode_"):
            name, value = line.split()
            values[name.split("spec_decode_")[1]] = float(value)
    return values


def run(extra: list[str], workloads: dict[str, list[str]], max_tokens: int) -> dict[str, dict]:
    """Starts a server with `extra` arguments, runs each workload's requests one after another, stops it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "optimum.commands.optimum_cli", "neuron-torch", "serve", "--port", str(port),
               "--batch-size", "1", "--max-length", "512", *extra]
    log = Path(tempfile.mkdtemp()) / "server.log"
    process, ready = start(command, url, log)
    while httpx.get(url + "/health", timeout=30).json()["graphs_unloaded"]:  # (measured once every graph is loaded)
        time.sleep(0.5)
    print(f"server {' '.join(extra) or '(no speculation)'} ready in {ready:.1f} s ({log})")
    results = {}
    try:
        ask(url, QUESTIONS[0], 8)  # (a first request: nothing measured)
        for name, prompts in workloads.items():
            before = counts(url)
            answers = [ask(url, prompt, max_tokens) for prompt in prompts]
            after = counts(url)
            decoded, seconds = sum(tokens - 1 for _, tokens, _ in answers), sum(seconds for *_, seconds in answers)
            results[name] = {"texts": [text for text, _, _ in answers], "tokens": decoded, "seconds": seconds,
                             "rate": decoded / seconds,
                             **{key: after[key] - before.get(key, 0.0) for key in after}}
    finally:
        stop(process)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    workloads = {"repetitive text": [REPEAT + paragraph for paragraph in PARAGRAPHS], "questions": QUESTIONS}
    config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    baseline = run([], workloads, args.max_tokens)
    speculative = run(["--speculative-config", json.dumps(config)], workloads, args.max_tokens)
    print(f"speculative config: {json.dumps(config)}; batch 1, greedy, the default model, --max-tokens "
          f"{args.max_tokens}")
    for name in workloads:
        off, on = baseline[name], speculative[name]
        drafted, accepted, steps = (on.get(key, 0.0) for key in ("num_draft_tokens", "num_accepted_tokens",
                                                                  "num_drafts"))
        per_step = (accepted + steps) / steps if steps else 0.0
        # (a decode step's time, from the run without; a verify step's, what the run with leaves for them)
        decode = off["seconds"] / off["tokens"]
        verify = (on["seconds"] - (on["tokens"] - accepted - steps) * decode) / steps if steps else 0.0
        print(f"{name}: decode {off['rate']:.1f} tokens/s without, {on['rate']:.1f} with: "
              f"{on['rate'] / off['rate']:.2f}x (target >= 1.5 on repetitive text); "
              f"acceptance {accepted / drafted if drafted else 0:.2f} ({accepted:.0f} of {drafted:.0f} drafted), "
              f"{steps:.0f} verify steps giving {per_step:.2f} tokens each (at most "
              f"{args.num_speculative_tokens + 1}); {on['tokens']} tokens decoded; "
              f"the same texts with and without: {off['texts'] == on['texts']}")
        if steps:
            print(f"  a decode step {1000 * decode:.1f} ms, a verify step {1000 * verify:.1f} ms "
                  f"({verify / decode:.2f}x): the limit of the ratio at this acceptance (every token from a verify "
                  f"step), {per_step:.2f} tokens per step x {decode / verify:.2f}, is "
                  f"{per_step * decode / verify:.2f}x; every draft taken, "
                  f"{(args.num_speculative_tokens + 1) * decode / verify:.2f}x")


if __name__ == "__main__":
    main()
