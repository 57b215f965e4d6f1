"""Vision-language models on `neuron`: LLaVA's generate() on compiled graphs (a text model's graphs
and an image encoder per batch bucket, whatever the images' number and sizes), its tokens those of
Transformers on the CPU."""

from __future__ import annotations

import warnings

import numpy
import PIL.Image
import pytest
import transformers

import optimum_neuron_torch as ont
from optimum_neuron_torch.generation import describe_plan
from testing_utils import clear_counts, graphs, recompiles
from tiny_models import save_audio_and_image_checkpoint


def image(height: int, width: int, seed: int) -> PIL.Image.Image:
    """A `height` x `width` image of 4 x 4 random blocks (which resizing keeps: pixel noise averages out)."""
    blocks = numpy.random.RandomState(seed).randint(0, 256, (4, 4, 3), dtype=numpy.uint8)
    return PIL.Image.fromarray(blocks).resize((width, height), PIL.Image.NEAREST)


def prompt(processor, images: int, question: str, question_first: bool = False) -> str:
    """The chat template's prompt of a user message with `images` images and `question` (after them,
    or before with `question_first`)."""
    content = [{"type": "image"}] * images
    content = [{"type": "text", "text": question}, *content] if question_first else [
        *content, {"type": "text", "text": question}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """(CPU model, the model on the device, its processor), from a tiny LLaVA checkpoint."""
    folder = save_audio_and_image_checkpoint("llava", tmp_path_factory.mktemp("llava"))
    processor = transformers.AutoProcessor.from_pretrained(folder)
    cpu = transformers.LlavaForConditionalGeneration.from_pretrained(folder).eval()
    return cpu, ont.NeuronAutoModelForImageTextToText.from_pretrained(folder), processor


def same_tokens(cpu, model, inputs: transformers.BatchFeature, **settings) -> None:
    """The device's greedy tokens for `inputs` are the CPU's, without a warning of eager generation."""
    expected = cpu.generate(**inputs, do_sample=False, **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generated = model.generate(**inputs.to("neuron"), do_sample=False, **settings)
    assert not [str(warning.message) for warning in caught if "eager" in str(warning.message)]
    assert generated.device.type == "neuron"
    assert generated.cpu().tolist() == expected.tolist()


def test_llava_generates_compiled_with_the_cpus_tokens(llava, fresh_dynamo):
    """The fast tier's check: one image on batch bucket 1 compiles a prefill, a decode step and an
    image encoder, and gives the CPU's tokens; the generation engine does not take image inputs,
    so the model's calls run on the static graphs (one graph set); images that do not match the
    prompt's placeholders fail with Transformers' own error."""
    cpu, model, processor = llava
    model.precompile(batch_sizes=(1,), prompt_buckets=(64,), max_length=96, show_progress=False)
    plan = model.neuron_generation.graph_plan()
    assert describe_plan(plan) == "4 graphs: 1 prefill, 1 chunk, 1 decode, 1 image encoder"
    assert graphs() == 4
    assert model.neuron_generation.engine_gap is None  # (the generation engine runs its calls)
    inputs = processor(images=[image(40, 50, 0)], text=[prompt(processor, 1, "what is it?")], return_tensors="pt")
    clear_counts()
    same_tokens(cpu, model, inputs, max_new_tokens=8)
    assert graphs() == 0 and recompiles() == 0
    two_images = dict(inputs, pixel_values=inputs.pixel_values.repeat(2, 1, 1, 1))  # (one placeholder)
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        cpu.generate(**two_images, max_new_tokens=2)
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        model.generate(**{name: value.to("neuron") for name, value in two_images.items()}, max_new_tokens=2)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["engine", "static graphs"])
def test_llava_generates_images_of_any_number_and_size_without_compiling_again(llava, path, fresh_dynamo):
    """After the warm-up of batch buckets 1 and 3 (prompt buckets 64 and 128), on the generation
    engine and on the static graphs (the path of a model whose engine failed): images of several
    sizes, one, two, four and seven images in a prompt (more than the largest batch bucket encodes
    at once; seven: a prompt longer than the largest prompt bucket, prefilled in two pieces, images
    on both sides of the cut), two prompts of different lengths (left-padded; on the static graphs
    filled to the bucket of 3 with a copy of the first, its image with it), a prompt without an
    image: the CPU's tokens, and no graph compiled after the warm-up."""
    cpu, model, processor = llava
    if path == "static graphs":
        model = ont.NeuronAutoModelForImageTextToText.from_pretrained(model.name_or_path)
        model.neuron_generation.engine_gap = "(this test's)"
    model.precompile(batch_sizes=(1, 3), prompt_buckets=(64, 128), max_length=288, show_progress=False)
    assert describe_plan(model.neuron_generation.graph_plan()) == (
        "7 graphs: 2 prefill, 1 chunk, 2 decode, 2 image encoder" if path == "engine"
        else "8 graphs: 4 prefill, 2 decode, 2 image encoder")
    clear_counts()
    processor.tokenizer.padding_side, processor.tokenizer.pad_token = "left", processor.tokenizer.eos_token
    calls = [
        ([image(64, 20, 2)], [prompt(processor, 1, "describe it")]),
        ([image(40, 50, 0), image(90, 70, 3)], [prompt(processor, 2, "which is brighter?")]),
        ([image(40, 50, 4), image(33, 33, 5), image(16, 80, 6), image(24, 24, 10)],
         [prompt(processor, 4, "and these four?")]),
        ([image(40, 50, 7), image(50, 40, 8)], [prompt(processor, 1, "a"), prompt(processor, 1, "a longer question")]),
        ([image(40, 50, 9)], [prompt(processor, 1, "one image"), prompt(processor, 0, "no image at all")]),
        # (longer than the largest prompt bucket: prefilled in two pieces, its images on both sides of the cut)
        ([image(30 + 5 * index, 40, 11 + index) for index in range(7)],
         [prompt(processor, 7, "count the ones that look like the sea, then name them all, one by one",
                 question_first=True)]),
    ]
    for images, texts in calls:
        inputs = processor(images=images, text=texts, return_tensors="pt", padding=True)
        same_tokens(cpu, model, inputs, max_new_tokens=10)
    text_only = processor(text=[prompt(processor, 0, "just text")], return_tensors="pt")
    same_tokens(cpu, model, text_only, max_new_tokens=10)
    assert graphs() == 0 and recompiles() == 0
