"""generate() of vision-language models (LLaVA and the models built like it) on static graphs: the
static-graph path (see `static_graphs`) with the images of a call encoded by a compiled vision
encoder and merged into the prompt's embeddings before its prefill graphs.

Such a model's forward turns an image into features (`get_image_features`: its vision tower and
projector), puts them where the prompt holds the image's placeholder tokens, and runs its language
model on those embeddings. Compiled as one graph, that forward would meet a new shape with every
count of images and every split of them across prefill chunks. Here it is cut in three:

- the images are encoded by one compiled graph per batch bucket of images (every image of a model
  whose processor resizes to a fixed size has one shape; a call with more images than the largest
  batch bucket is encoded a bucket at a time, the last filled with copies of its first image);
- the call then runs as a text call (its prompt padded to the buckets, see `static_graphs`), with
  the features handed to Transformers' generate() as `mm_encoder_outputs`, which Transformers'
  chunked prefill gives to the chunk holding each placeholder;
- each prefill chunk's embeddings (the tokens' embeddings with the features of the chunk's
  placeholders in their places) are made eagerly by the model's own code, stopped where it calls
  its language model, and the compiled prefill graph takes them (`inputs_embeds`): one graph per
  (batch bucket, prompt bucket), images or not. Decode steps take a token, as a text model's.

So a vision-language model compiles a text model's graphs plus one image encoder per batch bucket,
whatever the number and sizes of the images (for a processor that resizes them to one size). Its
calls take this path when the generation engine does not run them (a model whose engine failed);
the engine encodes and merges images the same way (see `images`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .buckets import Buckets, PlannedGraph
from .images import ImageEncoder, prompt_embeddings
from .static_graphs import StaticGraphs
from .static_plans import Shapes

# The image arguments the compiled path takes; a call with another image argument (image sizes of
# tiled images, pixel masks, ...) runs eagerly.
IMAGE_ARGUMENTS = ("pixel_values",)


class VisionLanguageGraphs(StaticGraphs):
    """The static-graph generation state of a vision-language model (see the module's docstring)."""

    def __init__(self, model: PreTrainedModel, buckets: Buckets) -> None:
        super().__init__(model, buckets)
        self.images = ImageEncoder(model)
        # The call running: the features of its images (placeholder order) and placeholders per row.
        self._call_images: tuple[torch.Tensor, list[int]] | None = None

    def forward(self, **inputs: Any) -> Any:
        """A step (see `StaticGraphs.forward`); a prefill chunk's tokens become their embeddings,
        with the features of its images in their places (`prompt_embeddings`)."""
        input_ids = inputs.get("input_ids")
        if input_ids is not None and input_ids.shape[-1] > 1:
            encoded = inputs.pop("mm_encoder_outputs", None)
            inputs["inputs_embeds"] = prompt_embeddings(self.model, inputs.pop("input_ids"),
                                                        encoded["image"].pooler_output[0] if encoded else None)
        return super().forward(**inputs)

    def _compiled_call(self, transformers_generate: Callable[..., Any], input_ids: torch.Tensor | None,
                       generation_config: GenerationConfig | None, config: GenerationConfig,
                       eager_because: str | None, kwargs: dict[str, Any]) -> Any:
        """A call with images: its images encoded (compiled), then the text call's path, or eager
        for image arguments it does not take, or images that do not match the placeholders (whose
        error Transformers' eager generate() raises)."""
        given = [name for name in kwargs if name not in IMAGE_ARGUMENTS and _is_image_argument(name, kwargs[name])]
        pixel_values = kwargs.get("pixel_values")
        if pixel_values is None or eager_because is not None:
            return super()._compiled_call(transformers_generate, input_ids, generation_config, config, eager_because,
                                          kwargs)
        if given or input_ids is None:
            self._warn_once(f"the image arguments {', '.join(given)}" if given
                            else "images and no input ids")
            return transformers_generate(input_ids, generation_config, **kwargs)
        placeholders = (input_ids == self.images.image_token).sum(dim=1).tolist()
        with self._serving():
            features = self.images.encode(pixel_values, self.buckets.batch_sizes)
        if sum(placeholders) != features.shape[0]:  # (Transformers' eager call raises the model's error)
            return transformers_generate(input_ids, generation_config, **kwargs)
        self._call_images = (features, placeholders)
        try:
            return super()._compiled_call(transformers_generate, input_ids, generation_config, config, None, kwargs)
        finally:
            self._call_images = None

    def _padded_call(self, input_ids: torch.Tensor, config: GenerationConfig, shapes: Shapes,
                     kwargs: dict[str, Any]) -> dict[str, Any]:
        """The text call's arguments (see `StaticGraphs._padded_call`), with the encoded images in
        place of `pixel_values`: the features of each row's placeholders, in the padded call's rows
        (a row repeated for `num_return_sequences`, the filler rows copies of the first)."""
        call = super()._padded_call(input_ids, config, shapes, kwargs)
        if self._call_images is None:
            return call
        features, placeholders = self._call_images
        starts = [sum(placeholders[:row]) for row in range(len(placeholders))]
        rows = [row for row in range(len(placeholders)) for _ in range(config.num_return_sequences or 1)]
        rows += [0] * (shapes.batch - len(rows))
        ordered = torch.cat([features[starts[row]:starts[row] + placeholders[row]] for row in rows])
        del call["pixel_values"]
        call["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=[ordered])}
        return call

    def graph_plan(self, buckets: Buckets | None = None, sampling: bool | None = None) -> list[PlannedGraph]:
        """A text model's graphs (see `StaticGraphs.graph_plan`), and an image encoder per batch
        bucket (of images of the vision tower's size, its `tokens`)."""
        buckets = buckets or self.buckets
        return [*super().graph_plan(buckets, sampling), *self.images.graph_plan(buckets.batch_sizes)]

    def precompile(self, show_progress: bool = True, sampling: bool | None = None) -> None:
        """A text model's graphs (see `StaticGraphs.precompile`), then the image encoder's, by
        encoding black images of the vision tower's size."""
        super().precompile(show_progress, sampling)
        with self._one_call, self._serving():
            self.images.precompile(self.buckets.batch_sizes, show_progress)


def _is_image_argument(name: str, value: Any) -> bool:
    """Whether a generate() argument is an image input this path does not take."""
    return value is not None and (name.startswith(("pixel_", "image_", "vision_")) or name == "mm_encoder_outputs")
