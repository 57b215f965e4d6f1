"""Vision-language models on `neuron`: LLaVA's generate() on compiled graphs (a text model's graphs
and an image encoder per batch bucket, whatever the images' number and sizes), its tokens those of
Transformers on the CPU."""

from __future__ import annotations

import warnings

import numpy
import PIL.Image
import pytest
import torch
import transformers

import optimum_neuron_torch as ont
from optimum_neuron_torch.generation import Buckets, describe_plan
from optimum_neuron_torch.generation.compiling import image_features
from optimum_neuron_torch.generation.images import prompt_embeddings
from optimum_neuron_torch.generation.static_plans import image_placeholder
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
    image encoder, and gives the CPU's tokens; the generation engine runs the model's calls (one
    graph set); images that do not match the prompt's placeholders fail with Transformers' own error."""
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


def test_an_encoder_decoder_vision_language_model_generates_eagerly_with_the_cpus_tokens(tmp_path):
    """Florence-2 merges its image features into its encoder's input, not into a prompt its decoder
    continues: it is not the placeholder-merging path's (which would decode the encoder's embeddings
    as a prompt: other tokens), and generates eagerly, with a warning naming the image argument."""
    vision = dict(depths=[1, 1], embed_dim=[16, 32], num_heads=[1, 2], num_groups=[1, 2], patch_size=[7, 3],
                  patch_stride=[4, 2], patch_padding=[3, 1], patch_prenorm=[False, True], projection_dim=32)
    text = dict(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128)
    config = transformers.Florence2Config(vision_config=vision, text_config=text, image_token_id=90)
    torch.manual_seed(0)
    cpu = transformers.Florence2ForConditionalGeneration(config).eval()
    with torch.no_grad():  # (noise: the tokens of a freshly initialized model ignore its image)
        generator = torch.Generator().manual_seed(0)
        for weight in cpu.parameters():
            weight.add_(0.3 * torch.randn(weight.shape, generator=generator))
    cpu.save_pretrained(tmp_path)
    pixel_values = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        placeholders = cpu.get_image_features(pixel_values=pixel_values).pooler_output.shape[1]
    ids = torch.tensor([[0, *[90] * placeholders, 5, 17, 33, 2]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values}
    expected = cpu.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    without_image = cpu.generate(**dict(inputs, pixel_values=torch.zeros_like(pixel_values)), max_new_tokens=6,
                                 min_new_tokens=6, do_sample=False)
    assert without_image.tolist() != expected.tolist()  # (the tokens tell whether the image was seen)
    model = ont.NeuronAutoModelForImageTextToText.from_pretrained(tmp_path)
    model.neuron_generation.set_buckets(Buckets((1,), (128,), 160))  # (the prompt fits)
    with pytest.warns(UserWarning, match="the encoder inputs pixel_values .* does not run on the compiled neuron"):
        generated = model.generate(**{name: value.to("neuron") for name, value in inputs.items()},
                                   max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert generated.cpu().tolist() == expected.tolist()
    assert image_placeholder(model) is None  # (nor does the generation engine take its images)


@pytest.mark.parametrize("kind", ["llava", "got_ocr2"])
def test_prompt_embeddings_are_those_the_models_forward_gives_its_language_model(kind, tmp_path):
    """The embeddings of a prompt with its images' features in place are those the model's own
    forward hands its language model, whether the model reads the features as a list of tensors
    (LLaVA: `torch.cat`) or as one tensor (GOT-OCR 2: `.to`)."""
    if kind == "llava":
        cpu = transformers.LlavaForConditionalGeneration.from_pretrained(
            save_audio_and_image_checkpoint("llava", tmp_path)).eval()
    else:
        vision = dict(hidden_size=32, output_channels=32, num_hidden_layers=2, num_attention_heads=4,
                      image_size=64, mlp_dim=64, window_size=2, global_attn_indexes=[1])
        text = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2)
        cpu = transformers.GotOcr2ForConditionalGeneration(
            transformers.GotOcr2Config(vision_config=vision, text_config=text, image_token_index=90)).eval()
    token = image_placeholder(cpu)
    side = cpu.config.vision_config.image_size
    pixel_values = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = image_features(cpu, pixel_values)
    ids = torch.tensor([[3, 4, *[token] * features.shape[1], 5, *[token] * features.shape[1], 6]])
    seen = []
    hook = cpu.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["inputs_embeds"]), with_kwargs=True)
    with torch.no_grad():
        cpu.model(input_ids=ids, pixel_values=pixel_values)
    hook.remove()
    embeds = prompt_embeddings(cpu, ids, features.reshape(-1, features.shape[-1]))
    assert torch.equal(embeds, seen[0])
    assert not torch.equal(embeds, prompt_embeddings(cpu, ids, features.flip(0).reshape(-1, features.shape[-1])))
