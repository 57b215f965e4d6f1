"""LoRA adapters served side by side (`generation.lora_adapters`): rows of different adapters in one step, each
answering as PEFT's model on the CPU; adapters loaded and unloaded while serving, compiling nothing."""

from __future__ import annotations

import json
import threading

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from starlette.testclient import TestClient

import optimum_neuron_torch as ont
from optimum_neuron_torch.compiler import cache_stats
from optimum_neuron_torch.errors import ConfigurationError, InvalidRequestError, ModelNotFoundError
from optimum_neuron_torch.generation.buckets import Buckets
from optimum_neuron_torch.generation.engine import GenerationEngine
from optimum_neuron_torch.generation.lora_adapters import AdapterSlots
from optimum_neuron_torch.generation.requests import ADAPTER, Request, SamplingSettings
from optimum_neuron_torch.serving.app import build_app
from testing_utils import wait_loaded
from tiny_models import chat_tokenizer, noisy_llama

# (graphs of their own, with the adapters' products: the fast tier serves an adapter through the command instead,
# test_serving.py::test_the_command_serves_on_localhost_and_drains_on_sigterm)
pytestmark = pytest.mark.slow

BUCKETS = Buckets((1, 2, 4), (16,), 64, (64,))
PROMPTS = [[5, 9, 3, 7, 1, 2], [4, 4, 8, 2], [7, 1, 9]]
ADAPTERS = {  # name: (rank, alpha, target modules, rslora)
    "attention": (4, 8, ["q_proj", "v_proj"], False),
    "everything": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "mlp": (2, 2, ["down_proj"], False),
}


def peft_adapter(base, folder, name: str):
    """A PEFT LoRA adapter of `base` (a copy), its B matrices random (PEFT starts them at zero), saved in
    `folder / name`: (the PEFT model on the CPU, its folder)."""
    rank, alpha, targets, rslora = ADAPTERS[name]
    torch.manual_seed(len(name))
    copy = noisy_llama(max_position_embeddings=64)
    copy.load_state_dict(base.state_dict())
    model = peft.get_peft_model(copy, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                      use_rslora=rslora, lora_dropout=0.0))
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "lora_" in parameter_name:
                parameter.normal_(0.0, 0.3)
    model.save_pretrained(folder / name)
    return model.eval(), folder / name


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny Llama on `neuron` with 2 adapter slots of rank up to 8 (an engine of 4 slots, 64 positions), the
    base model on the CPU, and the PEFT models of `ADAPTERS` on the CPU with their folders."""
    folder = tmp_path_factory.mktemp("lora")
    base = noisy_llama(max_position_embeddings=64)
    base.save_pretrained(folder / "base")
    chat_tokenizer().save_pretrained(folder / "base")
    peft_models = {name: peft_adapter(base, folder, name) for name in ADAPTERS}
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder / "base")
    engine = GenerationEngine(model, BUCKETS, chat_tokenizer())
    adapters = AdapterSlots(engine, max_loras=2, max_rank=8)
    engine.start(show_progress=False)
    wait_loaded(engine, timeout=900)
    yield engine, adapters, base, peft_models, folder
    engine.stop(60)
    adapters.detach()


def answer(engine, *jobs: tuple[list[int], str | None], new_tokens: int = 12) -> list[Request]:
    """Submits (prompt, adapter name) pairs at once; waits for their answers."""
    done = [threading.Event() for _ in jobs]
    requests = []
    for (prompt, name), ended in zip(jobs, done, strict=True):
        request = Request(list(prompt), new_tokens, SamplingSettings(), [],
                          lambda event, ended=ended: ended.set() if event.finish_reason else None, logprobs=0)
        if name is not None:
            engine.device.adapters.use(name, request)
        requests.append(request)
    for request in requests:
        engine.submit(request)
    assert all(ended.wait(300) for ended in done)
    return requests


def greedy(model, prompt: list[int], new_tokens: int = 12) -> list[int]:
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return output[0, len(prompt):].tolist()


def test_rows_of_different_adapters_share_the_steps_and_answer_as_peft_on_the_cpu(served, monkeypatch):
    """The base model and two adapters (ranks 4 and 8, attention only and every layer, rsLoRA's scale) in the
    same decode steps: each answer is its PEFT model's greedy answer on the CPU; nothing compiles."""
    engine, adapters, base, peft_models, folder = served
    for name in ("attention", "everything"):
        adapters.load(name, peft_models[name][1])
    mixed, run = [], engine.device.run
    monkeypatch.setattr(engine.device, "run", lambda ids, positions, last, context, uniform, sampling, *rest, **kw: (
        mixed.append({row[ADAPTER] for row in sampling}) if len(sampling) > 1 else None,
        run(ids, positions, last, context, uniform, sampling, *rest, **kw))[1])
    before = (cache_stats().misses, cache_stats().hits)
    requests = answer(engine, (PROMPTS[0], None), (PROMPTS[1], "attention"), (PROMPTS[2], "everything"),
                      (PROMPTS[0], "everything"))
    expected = [greedy(base, PROMPTS[0]), greedy(peft_models["attention"][0], PROMPTS[1]),
                greedy(peft_models["everything"][0], PROMPTS[2]), greedy(peft_models["everything"][0], PROMPTS[0])]
    assert [request.tokens for request in requests] == expected
    assert {0.0, 1.0, 2.0} in mixed  # (a decode step of rows of the base model and both adapters)
    assert (cache_stats().misses, cache_stats().hits) == before
    adapters.unload("attention")
    adapters.unload("everything")


def test_an_adapter_loaded_while_serving_compiles_nothing_and_unloading_frees_its_slot(served):
    engine, adapters, base, peft_models, folder = served
    before = (cache_stats().misses, cache_stats().hits)
    adapters.load("mlp", peft_models["mlp"][1])
    adapters.load("attention", peft_models["attention"][1])
    with pytest.raises(InvalidRequestError, match="every one of the 2 adapter slots"):
        adapters.load("everything", peft_models["everything"][1])
    adapters.unload("attention")
    assert adapters.load("everything", peft_models["everything"][1]) == 2  # (the slot "attention" left)
    [mlp, everything] = answer(engine, (PROMPTS[1], "mlp"), (PROMPTS[1], "everything"))
    assert mlp.tokens == greedy(peft_models["mlp"][0], PROMPTS[1])
    assert everything.tokens == greedy(peft_models["everything"][0], PROMPTS[1])
    assert (cache_stats().misses, cache_stats().hits) == before
    with pytest.raises(ModelNotFoundError, match="attention"):
        adapters.use("attention", Request([1], 1, SamplingSettings(), [], print))
    adapters.unload("mlp")
    adapters.unload("everything")


def test_a_slot_is_not_reused_while_a_request_of_its_unloaded_adapter_runs(served):
    """Unloading an adapter whose request still runs: the request keeps its adapter to its end (its answer is the
    adapter's), and its slot is not given to another adapter before."""
    engine, adapters, base, peft_models, folder = served
    adapters.load("mlp", peft_models["mlp"][1])
    adapters.load("attention", peft_models["attention"][1])
    started, proceed, ended = threading.Event(), threading.Event(), threading.Event()

    def on_event(event) -> None:  # (the engine's thread waits at the first token until the test has acted)
        if not started.is_set():
            started.set()
            proceed.wait(60)
        if event.finish_reason:
            ended.set()

    running = Request(PROMPTS[2], 40, SamplingSettings(), [], on_event)
    adapters.use("mlp", running)
    engine.submit(running)
    assert started.wait(120)
    adapters.unload("mlp")
    with pytest.raises(InvalidRequestError, match="adapter slots is in use"):
        adapters.load("everything", peft_models["everything"][1])  # (slot 1 still runs "mlp", slot 2 is loaded)
    proceed.set()
    assert ended.wait(120) and running.tokens == greedy(peft_models["mlp"][0], PROMPTS[2], 40)
    assert adapters.load("everything", peft_models["everything"][1]) == 1
    adapters.unload("everything")
    assert adapters.load("mlp", peft_models["mlp"][1]) == 1  # (into the slot of an adapter of every layer)
    [request] = answer(engine, (PROMPTS[0], "mlp"))
    assert request.tokens == greedy(peft_models["mlp"][0], PROMPTS[0])  # (nothing left of the one before)
    adapters.unload("attention")
    adapters.unload("mlp")


def test_an_adapter_that_cannot_be_served_is_refused_naming_why_and_nothing_is_written(served, tmp_path):
    engine, adapters, base, peft_models, folder = served
    source = peft_models["everything"][1]
    slots = [(module.lora_a.clone(), module.lora_b.clone()) for module in adapters.modules.values()]

    def broken(name: str, config: dict | None = None, tensors=None) -> str:
        target = tmp_path / name
        target.mkdir()
        saved = json.loads((source / "adapter_config.json").read_text())
        (target / "adapter_config.json").write_text(json.dumps({**saved, **(config or {})}))
        weights = load_file(source / "adapter_model.safetensors")
        save_file(tensors(weights) if tensors else weights, target / "adapter_model.safetensors")
        return str(target)

    key = next(key for key in load_file(source / "adapter_model.safetensors") if key.endswith("q_proj.lora_A.weight"))
    cases = [
        (str(tmp_path / "missing"), "adapter_config.json does not exist"),
        (broken("rank", {"r": 16}), "r=16 is above this server's largest rank, 8"),
        (broken("dora", {"use_dora": True}), "use_dora=True is not served"),
        (broken("shape", tensors=lambda weights: {**weights, key: weights[key][:, :-1].contiguous()}),
         f"{key} has the shape"),
        (broken("head", tensors=lambda weights: {
            **weights, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 32)}), "lm_head"),
        (broken("half", tensors=lambda weights: {name: tensor for name, tensor in weights.items()
                                                 if not name.endswith("lora_B.weight")}), "its lora_A and lora_B"),
    ]
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "adapter_config.json").write_text("{}")
    (tmp_path / "pickled" / "adapter_model.bin").write_bytes(b"")
    cases.append((str(tmp_path / "pickled"), "loads no pickle"))
    for path, message in cases:
        with pytest.raises(InvalidRequestError, match=message) as caught:
            adapters.load("bad", path)
        assert caught.value.param == "lora_path"
    assert "bad" not in adapters.names
    for module, (a, b) in zip(adapters.modules.values(), slots, strict=True):
        assert torch.equal(module.lora_a, a) and torch.equal(module.lora_b, b)
    adapters.load("mlp", peft_models["mlp"][1])
    with pytest.raises(InvalidRequestError, match="loaded already") as caught:
        adapters.load("mlp", peft_models["mlp"][1])
    assert caught.value.param == "lora_name"
    adapters.unload("mlp")
    with pytest.raises(ModelNotFoundError) as caught:
        adapters.unload("mlp")
    assert caught.value.param == "lora_name"


def test_the_server_loads_lists_serves_and_unloads_adapters(served):
    """vLLM's routes: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`; `/v1/models` lists each adapter
    with its parent; a request naming an adapter as its `model` gets its answer; once unloaded, a 404."""
    engine, adapters, base, peft_models, folder = served
    client = TestClient(build_app(engine, "tiny"))
    path = str(peft_models["attention"][1])
    loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": path})
    assert loaded.status_code == 200 and "sql" in loaded.text
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": path}).json()["error"][
        "param"] == "lora_name"
    listed = client.get("/v1/models").json()["data"]
    assert [(model["id"], model.get("parent"), model.get("root")) for model in listed] == [
        ("tiny", None, None), ("sql", "tiny", path)]
    assert client.get("/v1/models/sql").json()["parent"] == "tiny"
    answer = client.post("/v1/completions", json={"model": "sql", "prompt": PROMPTS[1], "max_tokens": 12,
                                                  "temperature": 0}).json()
    expected = greedy(peft_models["attention"][0], PROMPTS[1])
    assert answer["choices"][0]["text"] == chat_tokenizer().decode(expected, skip_special_tokens=True,
                                                                   clean_up_tokenization_spaces=False)
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
    gone = client.post("/v1/completions", json={"model": "sql", "prompt": "a", "max_tokens": 1})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    missing = client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"
    bad = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(folder / "nothing")})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"


def test_adapters_are_refused_with_prefix_caching_or_a_split_model(served):
    engine = served[0]
    with pytest.raises(ConfigurationError, match="prefix caching"):
        AdapterSlots(GenerationEngine(engine.model, BUCKETS, prefix_caching=True), 2, 8)
