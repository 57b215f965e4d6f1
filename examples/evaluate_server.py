"""Evaluating a served model with lm-eval's `local-completions`: a multiple-choice task and a generation task.

Start the server in another terminal with the graphs that score prompts (a multiple-choice task asks the
log-probability of each choice's tokens: `echo` with `logprobs`):

    optimum-cli neuron-torch serve --prompt-logprobs

then run (lm-eval is in the `eval` extra: `pip install "optimum-neuron-torch[eval]"`):

    python examples/evaluate_server.py

It writes two small tasks of its own (a few questions, local files: nothing is downloaded), runs them through
the server, and prints each task's score and the model's answers. `--tasks hellaswag,arc_easy` runs lm-eval's
own tasks instead (their datasets come from the Hub).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table

import optimum_neuron_torch

QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " Madrid"], "answer": 0},
    {"question": "Water freezes at", "choices": [" 0 degrees Celsius", " 50 degrees Celsius"], "answer": 0},
    {"question": "The largest planet of the solar system is", "choices": [" Jupiter", " Mercury"], "answer": 0},
    {"question": "A week has", "choices": [" seven days", " three days"], "answer": 0},
]
TASKS = {  # (lm-eval's task configuration, as its YAML files hold it)
    "neuron_choice": {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                      "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
    "neuron_answer": {"output_type": "generate_until", "doc_to_target": "{{choices[answer]}}",
                      "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 12, "do_sample": False},
                      "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]},
}


def write_tasks(folder: Path) -> list[str]:
    """Writes the tasks and their questions into `folder` (JSON is YAML): their names."""
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps(question) + "\n" for question in QUESTIONS))
    for name, task in TASKS.items():
        (folder / f"{name}.yaml").write_text(json.dumps({
            "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "doc_to_text": "{{question}}", **task}))
    return list(TASKS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="The server's address, with /v1.")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="The model's name on the server.")
    parser.add_argument("--tokenizer", help="The model's folder or Hub id, for its tokenizer (lm-eval sends token "
                                            "ids; default: the library's default model).")
    parser.add_argument("--tasks", help="lm-eval tasks, comma-separated (default: this example's own two).")
    args = parser.parse_args()

    tokenizer = args.tokenizer or optimum_neuron_torch.default_model_path()
    arguments = (f"model={args.model},base_url={args.base_url}/completions,tokenizer={tokenizer},"
                 "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1")
    with tempfile.TemporaryDirectory() as folder:
        tasks = args.tasks.split(",") if args.tasks else write_tasks(Path(folder))
        results = lm_eval.simple_evaluate(model="local-completions", model_args=arguments, tasks=tasks,
                                          task_manager=TaskManager(include_path=folder), log_samples=True)
    print(make_table(results))
    for sample in results["samples"].get("neuron_answer", []):
        print(f"{sample['doc']['question']!r} -> {sample['resps'][0][0]!r}")


if __name__ == "__main__":
    main()
