"""A client of `optimum-cli neuron-torch serve`, with the official `openai` package.

Start the server in another terminal (it compiles its graphs, or loads them from the compile cache,
then prints `Uvicorn running on http://127.0.0.1:8000`):

    optimum-cli neuron-torch serve

then run:

    python examples/serve_client.py

It asks one question and prints the answer, streams another as it comes, then sends four
questions at once: the server generates them together, in one batch.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="The server's address, with /v1.")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="The model's name on the server.")
    parser.add_argument("--api-key", default="none", help="The server's API key, if it was started with one.")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)

    print("models:", [model.id for model in client.models.list()])

    answer = client.chat.completions.create(
        model=args.model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0)
    print("answer:", repr(answer.choices[0].message.content))
    print(f"usage: {answer.usage.prompt_tokens} prompt tokens, {answer.usage.completion_tokens} completion tokens, "
          f"finish reason {answer.choices[0].finish_reason!r}")

    print("streamed: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=args.model, messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        max_tokens=48, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    questions = ["What is 2 + 2?", "Name a color.", "What is the largest ocean?", "Say hello in French."]

    async def ask_all() -> list[str]:
        batch_client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key)
        answers = await asyncio.gather(*(batch_client.chat.completions.create(
            model=args.model, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0)
            for question in questions))
        return [answer.choices[0].message.content for answer in answers]

    began = time.perf_counter()
    answers = asyncio.run(ask_all())
    print(f"{len(questions)} questions at once, answered in {time.perf_counter() - began:.1f} s:")
    for question, text in zip(questions, answers, strict=True):
        print(f"  {question!r} -> {text!r}")


if __name__ == "__main__":
    main()
