"""Images in chat messages (OpenAI's `image_url` parts), for a server of a vision-language model.

An image comes inline, as a data URL (`data:image/png;base64,...`, what the OpenAI client sends for
a local file); the server fetches no URL (a server that fetched what its clients name would reach
whatever its network reaches: vLLM gates it behind an allow-list of domains). The model's processor
makes the prompt: its chat template places each image's placeholder, and it expands the placeholder
to the image's tokens and gives the pixel values the engine encodes (see
`generation.images`).
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import PIL.Image
import torch

from ..errors import InvalidRequestError
from .protocol import Message

MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # (an image larger than this is refused, not decoded: PIL's bomb guard)


def read_image(url: str, field: str) -> PIL.Image.Image:
    """The image of a data URL, in RGB.

    Raises:
        InvalidRequestError: a URL that is not a base64 data URL of an image, or bytes that are no
            image PIL reads (names `field`).
    """
    header, comma, data = url.partition(",")
    if not (header.startswith("data:image/") and header.endswith(";base64") and comma):
        raise InvalidRequestError(f"{field}: this server reads images sent inline, as base64 data URLs "
                                  "(data:image/png;base64,...); it fetches no URL", field)
    try:
        image = PIL.Image.open(io.BytesIO(base64.b64decode(data, validate=True)))  # (its header only, so far)
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise InvalidRequestError(f"{field}: an image of {image.width} x {image.height} pixels, above the "
                                      f"{MAX_IMAGE_PIXELS} this server decodes", field)
        return image.convert("RGB")
    except (binascii.Error, OSError, PIL.Image.DecompressionBombError) as error:
        raise InvalidRequestError(f"{field}: not an image this server can read ({error})", field) from None


def chat_inputs(processor: Any, messages: list[Message], tools: list[dict[str, Any]] | None
                ) -> tuple[list[int], torch.Tensor | None]:
    """The prompt of a chat with images (its token ids, the image placeholders expanded) and the
    pixel values of its images (None: none), by the model's processor and chat template.

    Raises:
        InvalidRequestError: an image part this server cannot read (names it), or a processor
            without a chat template.
    """
    if not getattr(processor, "chat_template", None):
        raise InvalidRequestError("this model's processor has no chat template: use /v1/completions", "messages")
    conversation = []
    for index, message in enumerate(messages):
        images = dict(message.images())
        parts = message.content if isinstance(message.content, list) else [message.content or ""]
        content = [{"type": "image", "image": read_image(images[position], f"messages.{index}.content.{position}"
                                                                            ".image_url.url")}
                   if position in images else {"type": "text", "text": part if isinstance(part, str) else part.text}
                   for position, part in enumerate(parts)]
        conversation.append({**message.for_template(), "content": content})
    encoding = processor.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=True,
                                             return_dict=True, return_tensors="pt")
    return encoding["input_ids"][0].tolist(), encoding.get("pixel_values")
