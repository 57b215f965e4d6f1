#!/usr/bin/env python
"""Serving under load: this library's server (`optimum-cli neuron-torch serve`, on `neuron`) against
`transformers serve` on the CPU (its continuous batching), same model, prompts and client, in one run.

Each server runs alone (the machine's cores are not shared between them), started as a user
starts it; the startup time is printed (ours compiles, or loads from the compile cache, every graph
before /health turns ready). A bounded asyncio client (httpx, server-sent events) then holds
`c` chat requests in flight, for c in 1, 4, 8, 16: each of the `c` workers sends requests one after
another (greedy, `max_tokens` new tokens, prompts of several lengths, the same for both servers),
`max(2c, 8)` in all; with `--long-every N`, every Nth request asks about a document of
`--long-tokens` tokens (2,000 by default: a long prefill, which the server cuts into chunks
between the decode steps of the others), answered in `LONG_MAX_TOKENS` tokens. Measured: time to
first token (request sent -> first chunk with text), inter-token latency (the gaps between the
chunks of text of a request, p50 and p99) and aggregate output tokens/s (completion tokens, as the
server's usage counts them, over the wall time).

Then a soak of this library's server: `--soak` requests (default 500) at concurrency 16, short
answers, every `--soak-disconnect-every`th client (default 10th) going away after its first token;
failed requests are counted, and the busy slots and device memory (`/health` reports them) are read
before and after.

The physical limit, measured in the same run: the host's read bandwidth (best of 5 `x.sum()` over a
1 GiB float32 tensor) over the bytes a decode step must read (the model's weights), which bounds
the decode steps per second; times the batch, the output tokens/s no server of this model could pass.
And the rate at which the CPU's BLAS gets through the weights in a product of 1 and of 8 rows (what a
decode step of 1 and 8 sequences does to each weight matrix): on the reference device, where the
device is this CPU, the limit a batch-8 step meets first.

Each `--library-args` (repeatable) runs this library's server once more with those arguments (e.g.
`--library-args "--prompt-buckets 16,64"`: chunks of 64 prompt tokens a turn), in the same run.

Usage:
    python benchmarks/serve.py [--concurrency 1,4,8,16] [--max-tokens 64] [--soak 500] [--skip-transformers]
                               [--long-every 4] [--long-tokens 2000] [--library-args ARGS]...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

LONG_MAX_TOKENS = 32  # the answer to a long prompt (2,000 tokens leave 48 positions of a 2,048 cache)
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red.",
    "What does a compiler do? Answer for a ten-year-old.",
    "Translate 'good morning, how are you today?' into Spanish and German.",
    "Give me a short tip for writing readable Python code, with an example of a good function name.",
    "Summarize the plot of Romeo and Juliet in one paragraph, naming the two families and how it ends.",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(command: list[str], url: str, log: Path, timeout: float = 3600) -> tuple[subprocess.Popen, float]:
    """Starts a server; returns it and the seconds until /health answered 200."""
    began = time.perf_counter()
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    while time.perf_counter() - began < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {process.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return process, time.perf_counter() - began
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{command} not ready after {timeout} s; see {log}")


def stop(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(120)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def long_question(folder: str, tokens: int) -> str:
    """A question about a document, `tokens` tokens long once the chat template is applied."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    words = " ".join(QUESTIONS).split() * (tokens // 20 + 1)
    ask = "Summarize the text above in one sentence."

    def length(count: int) -> int:
        text = " ".join(words[:count]) + "\n" + ask
        return len(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"])

    low, high = 1, len(words)
    while low < high:  # (the most words whose prompt is at most `tokens` tokens)
        middle = (low + high + 1) // 2
        low, high = (middle, high) if length(middle) <= tokens else (low, middle - 1)
    return " ".join(words[:low]) + "\n" + ask


async def one_request(http: httpx.AsyncClient, model: str, question: str, max_tokens: int,
                      disconnect: bool = False) -> dict | None:
    """One streamed chat request: its time to first token, gaps between chunks of text, tokens; with
    `disconnect`, the client goes away after the first chunk of text (None)."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    arrivals, tokens = [], None
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                arrivals.append(time.perf_counter())
                if disconnect:
                    return None
    if not arrivals:
        raise RuntimeError("no text")
    return {"ttft": arrivals[0] - sent, "gaps": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
            "tokens": tokens if tokens is not None else len(arrivals)}


async def load(url: str, model: str, concurrency: int, requests: int, max_tokens: int, long: str | None = None,
               long_every: int = 0, disconnect_every: int = 0) -> dict:
    """`requests` requests from `concurrency` workers (every `long_every`th one the `long` question,
    answered in `LONG_MAX_TOKENS` tokens; every `disconnect_every`th one dropped by its client after
    its first chunk); the measurements and the failures."""
    queue: asyncio.Queue[tuple[str, int, bool]] = asyncio.Queue()
    for index in range(requests):
        drop = bool(disconnect_every) and index % disconnect_every == disconnect_every - 1
        if long is not None and long_every and index % long_every == long_every - 1:
            queue.put_nowait((long, LONG_MAX_TOKENS, drop))
        else:
            queue.put_nowait((QUESTIONS[index % len(QUESTIONS)], max_tokens, drop))
    results, failures = [], []

    async def worker(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            question, tokens, drop = queue.get_nowait()
            try:
                result = await one_request(http, model, question, tokens, drop)
                if result is not None:
                    results.append(result)
            except Exception as error:
                failures.append(f"{type(error).__name__}: {error}")

    began = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    wall = time.perf_counter() - began
    gaps = sorted(gap for result in results for gap in result["gaps"])
    return {
        "requests": len(results), "failed": len(failures), "failures": failures[:3],
        "ttft_p50_ms": 1000 * statistics.median(result["ttft"] for result in results) if results else None,
        "itl_p50_ms": 1000 * gaps[len(gaps) // 2] if gaps else None,
        "itl_p99_ms": 1000 * gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] if gaps else None,
        "tokens_per_s": sum(result["tokens"] for result in results) / wall,
    }


def sweep(url: str, model: str, concurrencies: list[int], max_tokens: int, **mix) -> dict[int, dict]:
    asyncio.run(load(url, model, 1, 1, 8))  # (a first request: warms the client and the server's code paths)
    rows = {}
    for concurrency in concurrencies:
        rows[concurrency] = asyncio.run(load(url, model, concurrency, max(2 * concurrency, 8), max_tokens, **mix))
        print(f"  c={concurrency:<3} {json.dumps(rows[concurrency])}", flush=True)
    return rows


def best_seconds(function, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - began)
    return best


def read_bandwidth() -> float:
    """Bytes per second of a plain read of a 1 GiB float32 tensor (best of 5)."""
    x = torch.ones(256 * 1024 * 1024)
    return x.nbytes / best_seconds(x.sum)


def matmul_weight_rate(rows: int) -> float:
    """Bytes of weights per second the CPU's BLAS gets through in `x[rows, 576] @ W.t()`, W of
    SmolLM2's MLP (1536 x 576, float32) over 64 such matrices (226 MB, beyond the caches): what a
    decode step of `rows` sequences does to each weight."""
    weights = [torch.randn(1536, 576) for _ in range(64)]
    x = torch.randn(rows, 576)
    return sum(w.nbytes for w in weights) / best_seconds(lambda: [x @ w.t() for w in weights])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--soak", type=int, default=500)
    parser.add_argument("--soak-disconnect-every", type=int, default=10,
                        help="in the soak, every Nth client goes away after its first token (0: none)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--long-every", type=int, default=0, help="every Nth request is a long prompt (0: none)")
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--library-args", action="append", default=[],
                        help="run the library's server once more with these arguments (repeatable)")
    args = parser.parse_args()
    concurrencies = [int(value) for value in args.concurrency.split(",")]

    from optimum_neuron_torch import default_model_path

    folder = str(default_model_path())
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    print(f"model: {folder}; threads: {torch.get_num_threads()}; max_tokens {args.max_tokens}", flush=True)
    mix = {}
    if args.long_every:
        mix = {"long": long_question(folder, args.long_tokens), "long_every": args.long_every}
        print(f"every {args.long_every}th request: a prompt of {args.long_tokens} tokens, "
              f"{LONG_MAX_TOKENS} new tokens", flush=True)
    bandwidth = read_bandwidth()
    weights = sum(path.stat().st_size for path in Path(folder).glob("*.safetensors"))
    steps = bandwidth / weights
    print(f"physical limit: read bandwidth {bandwidth / 1e9:.1f} GB/s over {weights / 1e6:.0f} MB of weights per "
          f"decode step = {steps:.1f} steps/s; x8 slots = {8 * steps:.0f} output tokens/s", flush=True)
    blas = {}
    for rows in (1, 8):
        rate = blas[rows] = matmul_weight_rate(rows)
        print(f"  BLAS x[{rows}, 576] @ W.t(): weights read at {rate / 1e9:.1f} GB/s = {rate / weights:.1f} steps/s, "
              f"{rows * rate / weights:.0f} output tokens/s at batch {rows}", flush=True)

    table = {}
    for index, extra in enumerate(["", *args.library_args]):
        name = f"library {extra}".strip()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = logs / f"serve-library-{index}.log"
        process, startup = start([sys.executable, "-m", "optimum.commands.optimum_cli", "neuron-torch", "serve",
                                  "--port", str(port), *shlex.split(extra)], url, log)
        print(f"{name}: ready after {startup:.1f} s (log: {log})", flush=True)
        try:
            table[name] = sweep(url, "SmolLM2-135M-Instruct", concurrencies, args.max_tokens, **mix)
            if args.soak and not index:
                before = httpx.get(url + "/health").json()
                soak = asyncio.run(load(url, "SmolLM2-135M-Instruct", 16, args.soak, 16,
                                        disconnect_every=args.soak_disconnect_every))
                after = httpx.get(url + "/health").json()
                for _ in range(600):  # (the engine notices the last disconnections within a step or two)
                    if (after["running"], after["waiting"]) == (0, 0):
                        break
                    time.sleep(0.1)
                    after = httpx.get(url + "/health").json()
                print(f"soak: {soak['requests']} answered, {soak['failed']} failed {soak['failures']}, every "
                      f"{args.soak_disconnect_every}th client gone after its first token; running/waiting "
                      f"{before['running']}/{before['waiting']} -> {after['running']}/{after['waiting']}; "
                      f"device memory {before['device_memory_allocated']} -> {after['device_memory_allocated']} "
                      "bytes", flush=True)
        finally:
            print(f"{name}: exit status after SIGTERM {stop(process)}", flush=True)

    if not args.skip_transformers:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        process, startup = start(["transformers", "serve", folder, "--continuous-batching", "--device", "cpu",
                                  "--port", str(port)], url, logs / "serve-transformers.log")
        print(f"transformers serve: ready after {startup:.1f} s", flush=True)
        try:
            table["transformers"] = sweep(url, folder, concurrencies, args.max_tokens, **mix)
        finally:
            stop(process)

    print("\n| concurrency | server | TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | output tokens/s "
          "| vs transformers |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for concurrency in concurrencies:
        for name, rows in table.items():
            row = rows[concurrency]
            ratio = ""
            if name.startswith("library") and "transformers" in table:
                ratio = f"{row['tokens_per_s'] / table['transformers'][concurrency]['tokens_per_s']:.2f}x"
            print(f"| {concurrency} | {name} | {row['ttft_p50_ms']:.0f} | {row['itl_p50_ms']:.1f} | "
                  f"{row['itl_p99_ms']:.1f} | {row['tokens_per_s']:.1f} | {ratio} |")
    floor = blas[1] / blas[8]  # (a batch-8 step's time over a batch-1 step's, reading the weights as BLAS does)
    print(f"\nphysical limit (BLAS): a batch-8 decode step takes {floor:.2f}x a batch-1 step, so ITL p99 c8 / c1 "
          f">= {floor:.2f} and tokens/s c8 / c1 <= {8 / floor:.2f}, before any prefill")
    for name, ours in table.items():
        if name.startswith("library") and 1 in ours and 8 in ours:
            print(f"{name}: tokens/s c8 / c1 = {ours[8]['tokens_per_s'] / ours[1]['tokens_per_s']:.2f} (target >= 3); "
                  f"ITL p99 c8 / c1 = {ours[8]['itl_p99_ms'] / ours[1]['itl_p99_ms']:.2f} (target <= 2); "
                  f"c8 tokens/s / read-bandwidth limit = {ours[8]['tokens_per_s'] / (8 * steps):.2f}, / BLAS batch-8 "
                  f"limit = {ours[8]['tokens_per_s'] / (8 * blas[8] / weights):.2f}")


if __name__ == "__main__":
    main()
