"""Real clients against the server, as users evaluate and benchmark with them: lm-eval's `local-completions` (a
multiple-choice task: loglikelihood, `echo` with `logprobs`, batches of token-id prompts; a generation task:
`generate_until`, stop strings; local files only) and guidellm's benchmark (concurrent streams of synthetic
prompts: content parts, `max_completion_tokens`, `ignore_eos`, vLLM's `stream_options` extensions); their numbers
and answers compared with Transformers' on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import lm_eval
import pytest
import torch
import uvicorn

import optimum_neuron_torch as ont
from optimum_neuron_torch.generation.buckets import Buckets
from optimum_neuron_torch.generation.engine import GenerationEngine
from optimum_neuron_torch.serving.app import build_app
from test_serving_app import TOKENIZER
from testing_utils import free_port
from tiny_models import greedy_answer, noisy_llama

QUESTIONS = [{"question": "the cat sat on the", "choices": [" mat", " city", " capital"], "answer": 0},
             {"question": "paris is the capital of", "choices": [" france", " the mat"], "answer": 0},
             {"question": "what is the capital of france? the capital is", "choices": [" paris", " a cat"],
              "answer": 0}]
TASKS = {
    "tiny_choice": {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                    "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
    "tiny_answer": {"output_type": "generate_until", "doc_to_target": "{{choices[answer]}}",
                    "generation_kwargs": {"until": ["?"], "max_gen_toks": 6, "do_sample": False},
                    "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of the tests' tiny Llama (2 slots, 64 positions, one prompt bucket, prompts scored) on localhost:
    (base URL, model folder, CPU model)."""
    cpu_model = noisy_llama()
    folder = tmp_path_factory.mktemp("tiny-llama")
    cpu_model.save_pretrained(folder)
    TOKENIZER.save_pretrained(folder)
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder)
    engine = GenerationEngine(model, Buckets.for_slots(model.config, 2, 64, (16,)), TOKENIZER, scoring=True)
    port = free_port()
    uvicorn_server = uvicorn.Server(uvicorn.Config(build_app(engine, "tiny"), host="127.0.0.1", port=port,
                                                   log_level="warning"))
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    engine.start(show_progress=False)
    engine.wait_ready(timeout=600)
    yield f"http://127.0.0.1:{port}", folder, cpu_model
    uvicorn_server.should_exit = True
    thread.join(60)


def test_lm_eval_local_completions_scores_and_answers_as_transformers_on_the_cpu(server, tmp_path, monkeypatch):
    """Each choice's loglikelihood (the sum of its tokens' log-probabilities given the question and the tokens
    before) and whether it is the greedy continuation, as Transformers computes them on the CPU; each generated
    answer Transformers' greedy one, cut at the task's stop string."""
    url, folder, cpu_model = server
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(question) + "\n" for question in QUESTIONS))
    for name, task in TASKS.items():  # (JSON is YAML: lm-eval reads the tasks of a folder)
        (tmp_path / f"{name}.yaml").write_text(json.dumps({
            "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "doc_to_text": "{{question}}", **task}))
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    arguments = (f"model=tiny,base_url={url}/v1/completions,tokenizer={folder},tokenizer_backend=huggingface,"
                 "num_concurrent=2,max_retries=1")
    results = lm_eval.simple_evaluate(model="local-completions", model_args=arguments, tasks=list(TASKS),
                                      task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    client = get_model("local-completions").create_from_arg_string(arguments)  # (its tokenization of each pair)
    scored = 0
    for sample in results["samples"]["tiny_choice"]:
        for (context, continuation), [(loglikelihood, greedy)] in zip(sample["arguments"], sample["resps"],
                                                                      strict=True):
            context_ids, continuation_ids = client._encode_pair(context, continuation)
            with torch.no_grad():
                logprobs = cpu_model(torch.tensor([context_ids + continuation_ids])).logits[0].log_softmax(-1)
            rows = logprobs[len(context_ids) - 1:-1]
            expected = rows.gather(1, torch.tensor(continuation_ids)[:, None]).sum().item()
            assert loglikelihood == pytest.approx(expected, abs=1e-4)
            assert greedy == (rows.argmax(-1) == torch.tensor(continuation_ids)).all().item()
            scored += 1
    assert scored == 7 and 0 <= results["results"]["tiny_choice"]["acc,none"] <= 1
    for sample in results["samples"]["tiny_answer"]:
        prompt = client.tok_encode(sample["arguments"][0][0])
        text = greedy_answer(cpu_model, TOKENIZER, prompt, 6)[1]
        assert sample["resps"] == [[text.split("?")[0]]]


def test_the_evaluation_example_runs_as_written(server):
    """examples/evaluate_server.py against the server: its two tasks' table and the answers it printed."""
    url, folder, _ = server
    example = Path(__file__).parent.parent / "examples" / "evaluate_server.py"
    result = subprocess.run([sys.executable, str(example), "--base-url", url + "/v1", "--model", "tiny",
                             "--tokenizer", str(folder)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "|neuron_choice|" in result.stdout and "|neuron_answer|" in result.stdout
    assert result.stdout.count(" -> ") == 4  # (each question's answer)


def test_guidellm_benchmarks_the_server_and_every_request_gets_the_cpu_answer(server, tmp_path):
    """`guidellm run`, 2 concurrent streams of 8 requests of synthetic prompts (16 tokens, 8 new): every request
    succeeds with its 8 tokens, each answer Transformers' greedy one for its chat messages."""
    url, folder, cpu_model = server
    report = tmp_path / "report.json"
    result = subprocess.run(
        ["guidellm", "run", "--backend", f"kind=openai_http,target={url},model=tiny",
         "--profile", "kind=concurrent,streams=2", "--constraint", "kind=max_requests,count=8",
         "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
         "--tokenizer", f"kind=huggingface_auto,model={folder}", "--output", f"kind=json,path={report}",
         "--disable-console-interactive"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    assert benchmark["metrics"]["request_totals"] == {"successful": 8, "errored": 0, "incomplete": 0, "total": 8}
    for request in benchmark["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        prompt = TOKENIZER.apply_chat_template([{"role": message["role"], "content": "".join(
            part["text"] for part in message["content"])} for message in body["messages"]], add_generation_prompt=True,
            tokenize=True, return_dict=True)["input_ids"]
        assert request["output_tokens"] == 8 and request["output"] == greedy_answer(cpu_model, TOKENIZER, prompt, 8)[1]
