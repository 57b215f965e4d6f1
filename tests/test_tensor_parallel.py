"""Tensor-parallel models on `neuron`: `from_pretrained(..., tp_size=N)` under `torchrun`.

The programs run in tests/tensor_parallel_programs.py on 2 and 4 real processes (torchrun); every
check there compares the model split between the ranks with the whole model run by Transformers in
one process on the CPU: logits, greedy tokens through the compiled graphs, sampling, memory.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from testing_utils import failures, launch, launcher_environment, names, optimum_cli, rank_checks, start_ranks
from tiny_models import TENSOR_PARALLEL_MODELS, TINY_MODELS

PROGRAMS = Path(__file__).with_name("tensor_parallel_programs.py")
EXAMPLE = Path(__file__).parent.parent / "examples" / "tensor_parallel.py"
COMPILE_CACHE: Path  # one per test module: the jobs, the commands and the example share their compiled graphs
ARCHITECTURES = tuple(TENSOR_PARALLEL_MODELS)  # each checked at 2 ranks
# At 4 ranks, the architectures whose split depends most on the number of ranks (9 architectures on 4
# processes over 2 cores took 475 s of the slow tier): projections packed in one weight whose output
# is gathered (phi3's qkv_proj and gate_up_proj), experts (qwen3_moe), a head_dim of its own with
# sliding-window layers (gemma3), tied embeddings and sampling in the graph (llama).
FOUR_RANK_ARCHITECTURES = ("gemma3", "llama", "phi3", "qwen3_moe")


def job_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"OPTIMUM_NEURON_TORCH_COMPILE_CACHE": str(COMPILE_CACHE), "OPTIMUM_NEURON_TORCH_DEVICE_MEMORY": "256MB",
            **(extra or {})}


def run_programs(out: Path, models: Path, world: int, *programs: str,
                 env: dict[str, str] | None = None) -> list[list[dict]]:
    launch(world, str(PROGRAMS), str(out), str(models), *programs, env=job_environment(env), timeout=900)
    return rank_checks(out, world)


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    global COMPILE_CACHE
    COMPILE_CACHE = tmp_path_factory.mktemp("compiled")


def _models(folder: Path, architectures: tuple[str, ...] = ARCHITECTURES) -> Path:
    for name in architectures:
        TENSOR_PARALLEL_MODELS[name].save(folder / name)
    TENSOR_PARALLEL_MODELS["llama"].save_with_tokenizer(folder / "_with_tokenizer")
    TINY_MODELS["gpt2"].save(folder / "_gpt2")
    corrupt = TENSOR_PARALLEL_MODELS["llama"].save(folder / "_corrupt")
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # truncated
    return folder


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[list[dict]]:
    models = _models(tmp_path_factory.mktemp("models2"))
    return run_programs(tmp_path_factory.mktemp("two_ranks"), models, 2, "models", "errors", "save", "pipeline",
                        "context")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[list[dict]]:
    models = _models(tmp_path_factory.mktemp("models4"), FOUR_RANK_ARCHITECTURES)
    return run_programs(tmp_path_factory.mktemp("four_ranks"), models, 4, "models", "errors")


def _checked(checks: list[list[dict]], name: str) -> set[str]:
    return {check["name"].split(": ", 1)[1] for rank in checks for check in rank
            if check["program"] == "models" and check["name"].startswith(f"{name}: ")}


@pytest.mark.slow
@pytest.mark.parametrize("program", ["models", "errors", "save", "pipeline", "context"])
def test_two_ranks(two_ranks, program):
    assert names(two_ranks, program), f"program {program!r} made no check"
    assert not failures(two_ranks, program)


@pytest.mark.slow
@pytest.mark.parametrize("program", ["models", "errors"])
def test_four_ranks(four_ranks, program):
    assert not failures(four_ranks, program)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_architecture_fully_checked(two_ranks, four_ranks, world):
    checks = two_ranks if world == 2 else four_ranks
    assert len(checks) == world and all(checks)
    expected = _checked(checks, "llama")
    assert {"logits", "compiled greedy tokens", "no compile after warm-up", "sampled tokens identical on every rank",
            "device memory is this rank's share plus the replicated tensors"} <= expected
    architectures = ARCHITECTURES if world == 2 else FOUR_RANK_ARCHITECTURES
    for name in architectures:
        assert _checked(checks, name) == expected, name
    assert {name for name in ARCHITECTURES if _checked(checks, name)} == set(architectures)


@pytest.mark.slow
def test_every_failure_checked(two_ranks, four_ranks):
    for checks in (two_ranks, four_ranks):
        names = {check["name"] for rank in checks for check in rank if check["program"] == "errors"}
        assert {"a corrupt file seen by one rank", "a rank without the device memory",
                "SmolLM2-135M: 9 heads, 3 key-value heads", "a model without a plan"} <= names


def test_tensor_parallel_arguments_on_one_process(tmp_path):
    """Outside a launcher: tp_size=1 is one device; a larger one names the launch to use."""
    import optimum_neuron_torch as ont

    folder = TENSOR_PARALLEL_MODELS["llama"].save(tmp_path / "llama")
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder, tp_size=1)
    assert model.device.type == "neuron"
    with pytest.raises(ont.errors.ConfigurationError, match="torchrun --nproc-per-node 2"):
        ont.NeuronAutoModelForCausalLM.from_pretrained(folder, tp_size=2)
    with pytest.raises(ont.errors.ConfigurationError, match="tensor parallelism only"):
        ont.NeuronAutoModelForCausalLM.from_pretrained(folder, distributed_config={"tp_size": 1, "fsdp_size": 2})
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_the_commands_start_the_ranks(tmp_path):
    """`generate --tp-size 2` starts 2 ranks through torch's launcher and prints rank 0's text only, the
    CPU's; `compile --tp-size 2 --save` saves both ranks' graphs, which another degree compiles again."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import optimum_neuron_torch as ont

    folder = TENSOR_PARALLEL_MODELS["llama"].save_with_tokenizer(tmp_path / "llama")
    cli_env = launcher_environment(job_environment())
    prompt = "the quick brown fox"
    result = optimum_cli("generate", "--model", str(folder), "--tp-size", "2", "--max-new-tokens", "6",
                         "--no-chat-template", env=cli_env, input=prompt, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer(prompt, return_tensors="pt")
    tokens = AutoModelForCausalLM.from_pretrained(folder).generate(**inputs, max_new_tokens=6, do_sample=False)
    expected = tokenizer.decode(tokens[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert result.stdout.strip() == expected.strip()

    saved = tmp_path / "saved"
    result = optimum_cli("compile", str(folder), "--tp-size", "2", "--batch-sizes", "1", "--prompt-buckets", "16",
                         "--max-length", "32", "--save", str(saved), env=cli_env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "split between 2 ranks" in result.stdout and result.stdout.count("graphs compiled") == 1
    spec = json.loads((saved / "neuron_generation.json").read_text())
    # per rank, the engine's prefill, chunk, decode step and sampling decode step (on the one context bucket,
    # 32): each a compiled program and its saved function (warm starts)
    assert spec["tp_size"] == 2 and len(spec["graphs"]) == 2 * (4 + 4)
    with pytest.warns(UserWarning, match="tp_size: saved 2, here 1.*compiled again"):
        ont.NeuronAutoModelForCausalLM.from_pretrained(saved)

    result = optimum_cli("generate", "--model", str(folder), "--tp-size", "3", "oops", env=cli_env)
    assert result.returncode == 2
    assert "error (rank " in result.stderr and "tp_size=3 does not divide" in result.stderr


@pytest.mark.slow  # (75 s of the fast tier's 10 minutes; every other multi-rank program runs in the slow tier)
def test_the_example_runs_under_torchrun(tmp_path):
    folder = TENSOR_PARALLEL_MODELS["llama"].save_with_tokenizer(tmp_path / "llama")
    stdout = launch(2, str(EXAMPLE), "--model", str(folder), "--new-tokens", "6", env=job_environment()).stdout
    assert "split between 2 ranks" in stdout and "device memory per rank" in stdout
    assert "same tokens as the whole model on the CPU: True" in stdout


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """The Hub's file endpoint (`/{repo}/resolve/{revision}/{file}`, HEAD and GET) for one repository,
    counting the requests made for each file."""

    files: dict[str, bytes] = {}
    requests: Counter = Counter()

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
        self._answer(send_body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(send_body=True)

    def _answer(self, send_body: bool) -> None:
        parts = self.path.split("?")[0].strip("/").split("/")  # owner, name, "resolve", revision, file...
        data = None
        if len(parts) > 4 and parts[2] == "resolve":  # (huggingface_hub's other calls, its /api/ ones, get a 404)
            filename = "/".join(parts[4:])
            self.requests[(self.command, filename)] += 1
            data = self.files.get(filename)
        if data is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("X-Repo-Commit", "c" * 40)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if send_body:
            self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def test_a_hub_model_is_downloaded_once_per_host(tmp_path):
    """Two ranks load a Hub id: local rank 0 downloads each file once, the other reads the cache."""
    folder = TENSOR_PARALLEL_MODELS["llama"].save(tmp_path / "repo")
    _FakeHub.files = {path.name: path.read_bytes() for path in folder.iterdir()}
    _FakeHub.requests = Counter()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        models = tmp_path / "models"
        models.mkdir()
        checks = run_programs(tmp_path, models, 2, "hub", env={
            "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "HF_HUB_CACHE": str(tmp_path / "cache"),
            "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"})
    finally:
        server.shutdown()
    assert not failures(checks, "hub") and all(checks)
    downloads = {name: count for (method, name), count in _FakeHub.requests.items() if method == "GET"}
    assert downloads == {name: 1 for name in _FakeHub.files}, _FakeHub.requests
    assert max(_FakeHub.requests.values()) == 1, _FakeHub.requests  # nor asked twice about a file


@pytest.mark.slow
def test_a_rank_killed_mid_generation_fails_the_other_naming_it(tmp_path):
    models = tmp_path / "models"
    TENSOR_PARALLEL_MODELS["llama"].save(models / "llama")
    codes, checks, errors = start_ranks(2, str(PROGRAMS), str(tmp_path), str(models), "killed", out=tmp_path,
                                        env=job_environment({"OPTIMUM_NEURON_TORCH_DISTRIBUTED_TIMEOUT": "60"}),
                                        timeout=900)
    assert codes[1] == -9, errors[1][-3000:]
    (report,) = [check for check in checks[0] if check["name"] == "generation failed"]
    assert report["ok"], report
    assert "rank(s) 1 of this group exited" in report["error"]
