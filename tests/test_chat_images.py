"""`serving.chat_images.read_image`: what an `image_url` part of a chat message becomes, and what is refused
with the part named (the OpenAI shapes of the messages are `serving.protocol`'s)."""

from __future__ import annotations

import base64
import io
import json

import PIL.Image
import pytest

from optimum_neuron_torch.errors import InvalidRequestError
from optimum_neuron_torch.serving.chat_images import MAX_IMAGE_PIXELS, read_image
from optimum_neuron_torch.serving.protocol import ChatCompletionRequest, ImagePart, TextPart, parse

FIELD = "messages.0.content.1.image_url.url"


def data_url(image: PIL.Image.Image, form: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=form)
    return f"data:image/{form.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("form", ["PNG", "JPEG"])
def test_a_data_url_reads_as_the_rgb_image_it_holds(form):
    image = PIL.Image.new("L", (5, 7), 200)
    read = read_image(data_url(image, form), FIELD)
    assert (read.mode, read.size, read.getpixel((2, 3))) == ("RGB", (5, 7), (200, 200, 200))


@pytest.mark.parametrize(("url", "message"), [
    ("https://example.com/cat.png", "it fetches no URL"),
    ("data:text/plain;base64,aGVsbG8=", "it fetches no URL"),
    ("data:image/png,raw", "it fetches no URL"),
    ("data:image/png;base64,%%%", "not an image this server can read"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not an image this server can read"),
])
def test_what_is_not_an_inline_image_is_refused_naming_the_part(url, message):
    with pytest.raises(InvalidRequestError) as error:
        read_image(url, FIELD)
    assert error.value.param == FIELD and message in str(error.value) and str(error.value).startswith(FIELD)


def test_an_image_above_the_pixel_limit_is_refused_from_its_header_before_it_is_decoded(monkeypatch):
    side = int(MAX_IMAGE_PIXELS**0.5) + 1
    url = data_url(PIL.Image.new("1", (side, side)))  # (a bilevel image: a few kilobytes compressed)
    decoded = []
    monkeypatch.setattr(PIL.Image.Image, "convert", lambda *args, **kwargs: decoded.append(args))
    with pytest.raises(InvalidRequestError, match=f"{side} x {side} pixels"):
        read_image(url, FIELD)
    assert not decoded


def test_messages_take_text_and_image_parts_and_their_text_skips_the_images():
    body = parse(json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is "}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
        {"type": "text", "text": "this?"}]}]}).encode(), ChatCompletionRequest)
    message = body.messages[0]
    assert [type(part) for part in message.content] == [TextPart, ImagePart, TextPart]
    assert message.text() == "what is this?" and message.images() == [(1, "data:image/png;base64,AA")]
