#!/usr/bin/env python
"""Prefix caching: time to first token of a chat request whose long document (`--prefix-tokens`, 1,000 by
default) the server already holds, against the same request when it does not, in one run.

This library's server (`optimum-cli neuron-torch serve --enable-prefix-caching`, the default model on
`neuron`, `--batch-size` slots), once it has loaded every graph, gets for each of `--documents` documents
a first question about it (the document not cached: a whole prefill) then a second (its prompt's first
~1,000 tokens reused: only the rest is prefilled, in a `suffix` graph). Then the second question about the
first document again, once other documents have taken every slot: not cached, its tokens must equal the
cached answer's. Measured:
time to first token (streamed, greedy) of each; printed: the medians and their ratio (target: at most
1/4), and the limit the ratio meets, the share of the prompt's tokens a cached request still prefills.

Usage:
    python benchmarks/prefix_cache.py [--prefix-tokens 1000] [--documents 4] [--batch-size 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve import QUESTIONS, free_port, long_question, start, stop
from transformers import AutoTokenizer

import optimum_neuron_torch

MAX_TOKENS = 16


async def ask(url: str, model: str, content: str) -> tuple[float, str]:
    """One streamed greedy chat request: its time to first token and its text."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        sent, first, text = asyncio.get_running_loop().time(), None, []
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
                content = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
                if content:
                    first = first or asyncio.get_running_loop().time()
                    text.append(content)
    return first - sent, "".join(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    args = parser.parse_args()

    folder = str(optimum_neuron_torch.default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    base = long_question(folder, args.prefix_tokens).rsplit("\n", 1)[0]
    words = base.split()
    documents = [" ".join(words[index:] + words[:index]) for index in range(1, 1 + 7 * args.documents, 7)]
    first, second = QUESTIONS[0], QUESTIONS[2]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "optimum.commands.optimum_cli", "neuron-torch", "serve", "--port", str(port),
               "--batch-size", str(args.batch_size), "--enable-prefix-caching"]
    log = Path(tempfile.mkdtemp()) / "server.log"
    process, ready = start(command, url, log)
    print(f"server ready in {ready:.1f} s ({log})")
    while httpx.get(url + "/health", timeout=30).json()["graphs_unloaded"]:  # (measured once every graph is loaded)
        time.sleep(0.5)
    model = "SmolLM2-135M-Instruct"
    try:
        uncached, cached, answers = [], [], []
        for document in documents:
            seconds, _ = asyncio.run(ask(url, model, f"{document}\n{first}"))
            uncached.append(seconds)
            seconds, text = asyncio.run(ask(url, model, f"{document}\n{second}"))
            cached.append(seconds)
            answers.append(text)
        again, text = asyncio.run(ask(url, model, f"{documents[0]}\n{second}"))  # (evicted: not cached)
        uncached.append(again)
    finally:
        stop(process)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"{documents[0]}\n{question}"}],
                                             add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for question in (first, second)]
    prompt = len(prompts[1])
    shared = next(index for index, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)
    ratio = statistics.median(cached) / statistics.median(uncached)
    print(f"prompt: {prompt} tokens, {shared} shared by the two questions of a document")
    print(f"time to first token, not cached: median {1000 * statistics.median(uncached):.0f} ms "
          f"({', '.join(f'{1000 * value:.0f}' for value in uncached)})")
    print(f"time to first token, cached:     median {1000 * statistics.median(cached):.0f} ms "
          f"({', '.join(f'{1000 * value:.0f}' for value in cached)})")
    print(f"cached / not cached: {ratio:.3f} (target <= 0.25); the tokens a cached request still prefills: "
          f"{(prompt - shared // 16 * 16) / prompt:.3f} of the prompt's (the compute limit of the ratio)")
    print(f"the same tokens cached and not: {text == answers[0]}")


if __name__ == "__main__":
    main()
