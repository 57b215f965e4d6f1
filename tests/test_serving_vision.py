"""A vision-language model served: OpenAI's chat messages with `image_url` parts (data URLs) answered
by a tiny LLaVA on the generation engine's compiled graphs, as Transformers answers the same chat on
the CPU; images refused with the part named when the server cannot read them."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import pytest
import torch
import transformers
from test_vision_language import image

from optimum_neuron_torch.commands.models import load_generative_model
from optimum_neuron_torch.generation.buckets import Buckets
from optimum_neuron_torch.generation.engine import GenerationEngine
from optimum_neuron_torch.serving.app import build_app
from test_serving_app import call
from testing_utils import clear_counts, graphs, recompiles, wait_loaded
from tiny_models import save_audio_and_image_checkpoint

pytestmark = pytest.mark.slow  # (the fast tier compiles LLaVA's graphs once, in test_vision_language.py)

NAME = "tiny-llava"


def data_url(picture) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def user(*parts) -> list[dict]:
    """A chat of one user message: each part an image (a PIL image) or text."""
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(part)}} if not isinstance(part, str)
        else {"type": "text", "text": part} for part in parts]}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(application over an engine of a tiny LLaVA, loaded as `serve` loads it; the CPU model; its processor)."""
    folder = save_audio_and_image_checkpoint("llava", tmp_path_factory.mktemp("llava"))
    model = load_generative_model(str(folder))
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    processor = transformers.AutoProcessor.from_pretrained(folder)
    # (the buckets of test_vision_language.py's engine test: the graphs they share compile once)
    engine = GenerationEngine(model, Buckets((1, 3), (64, 128), 288), processor.tokenizer)
    engine.start(show_progress=False)
    engine.wait_ready(timeout=600)
    wait_loaded(engine)
    cpu = transformers.LlavaForConditionalGeneration.from_pretrained(folder).eval()
    yield build_app(engine, NAME, processor=processor), cpu, processor
    engine.stop(60)
    assert not engine.alive


def cpu_answer(cpu, processor, parts: tuple, tokens: int) -> str:
    """Transformers' greedy answer on the CPU to the chat of `parts`, as text."""
    content = [{"type": "text", "text": part} if isinstance(part, str) else {"type": "image", "image": part}
               for part in parts]
    inputs = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        output = cpu.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return processor.tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_chats_with_images_get_the_cpus_answers_without_compiling(served):
    """One image, two images, no image, and two chats at once (sharing the decode steps): each gets
    Transformers' greedy answer on the CPU, and the engine compiles nothing after its warm-up."""
    app, cpu, processor = served
    chats = [(image(40, 50, 0), "what is it?"), ("describe", image(64, 20, 1), "and", image(30, 30, 2)),
             ("just text, no image",)]
    clear_counts()
    for parts in chats:
        answer = call(app, "POST", "/v1/chat/completions", json={"model": NAME, "messages": user(*parts),
                                                                   "max_tokens": 8})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == cpu_answer(cpu, processor, parts, 8)

    async def both() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/chat/completions", json={
                "model": NAME, "messages": user(*parts), "max_tokens": 8}) for parts in chats[:2]))

    for parts, answer in zip(chats[:2], asyncio.run(both()), strict=True):
        assert answer.json()["choices"][0]["message"]["content"] == cpu_answer(cpu, processor, parts, 8)
    assert graphs() == 0 and recompiles() == 0


@pytest.mark.parametrize(("url", "message"), [
    ("https://example.com/cat.png", "this server reads images sent inline, as base64 data URLs"),
    ("data:image/png;base64,bm90IGFuIGltYWdl", "not an image this server can read"),
    ("data:image/png;base64,%%%", "not an image this server can read"),
])
def test_an_image_the_server_cannot_read_is_refused_naming_the_part(served, url, message):
    app = served[0]
    messages = [{"role": "user", "content": [{"type": "text", "text": "look:"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    response = call(app, "POST", "/v1/chat/completions", json={"model": NAME, "messages": messages})
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, "messages.0.content.1.image_url.url")
    assert message in error["message"]
