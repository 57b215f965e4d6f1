"""A vision-language model's images on the device: their features, from a vision encoder compiled once
per batch bucket of images (`ImageEncoder`), and a prompt's embeddings with those features in the
places of its image placeholders (`prompt_embeddings`), made by the model's own code. Both paths of
generation use them: the generation engine's prefills (`slots`) and the static graphs
(`vision_graphs`, whose docstring tells why a prompt's images are cut from its compiled graphs).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.utils.output_capturing import maybe_install_capturing_hooks

from ..compiler import regions
from .buckets import PlannedGraph
from .compiling import COMPILE_CONFIG, dense, image_features
from .padding import fill_batch
from .split_model import whole_graphs_reason
from .static_plans import image_placeholder


class ImageEncoder:
    """A vision-language model's images to features, compiled: its `get_image_features` (vision
    tower and projector), one graph per batch bucket of images (see the module's docstring).

    Args:
        model (`PreTrainedModel`): the model on the device (held weakly: the model holds this object).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = weakref.ref(model)
        self._compiled: Callable[..., Any] | None = None
        self.image_token: int | None = image_placeholder(model)
        self.tokens_per_image = 0  # (the features of an image, known once one is encoded)

    @property
    def model(self) -> PreTrainedModel:
        return self._model()

    def encode(self, pixel_values: torch.Tensor, batch_sizes: tuple[int, ...]) -> torch.Tensor:
        """The features of `pixel_values`' images, `[images * tokens, hidden]` on the device (the
        rows of their placeholders, in order), a batch bucket of `batch_sizes` at a time, the last
        filled with copies of its first image."""
        model = self.model
        if self._compiled is None:
            _install_output_capturing_hooks(model)
            self._compiled = regions.compile_by_layer(image_features, whole_because=whole_graphs_reason(model),
                                                      **COMPILE_CONFIG.to_dict())
        pixel_values = pixel_values.to(model.device, model.dtype)
        features = []
        for start in range(0, pixel_values.shape[0], batch_sizes[-1]):
            group = pixel_values[start:start + batch_sizes[-1]]
            batch = next(size for size in batch_sizes if size >= group.shape[0])
            with torch.no_grad():  # (one graph whoever calls: the engine's steps and generate() run without grad)
                features.append(self._compiled(model, pixel_values=dense(fill_batch(group, batch)))[:group.shape[0]])
        features = torch.cat(features)
        self.tokens_per_image = features.shape[1]
        return features.reshape(-1, features.shape[-1])

    def graph_plan(self, batch_sizes: tuple[int, ...]) -> list[PlannedGraph]:
        """An encoder per batch bucket, of images of the vision tower's size (its `tokens`)."""
        size = self.model.config.vision_config.image_size
        return [PlannedGraph("image encoder", batch, size, 0) for batch in batch_sizes]

    def precompile(self, batch_sizes: tuple[int, ...], show_progress: bool = True) -> None:
        """Compiles (or loads) the graphs of `graph_plan`, by encoding black images."""
        model = self.model
        channels = getattr(model.config.vision_config, "num_channels", 3)
        for graph in tqdm(self.graph_plan(batch_sizes), desc="Compiling neuron graphs", disable=not show_progress):
            self.encode(torch.zeros((graph.batch, channels, graph.tokens, graph.tokens)), (graph.batch,))


def prompt_embeddings(model: PreTrainedModel, input_ids: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
    """What a vision-language model's own forward hands its language model for `input_ids` and the
    features of their image placeholders (`[placeholders, hidden]`, in order; None: no image): the
    forward runs eagerly up to its language model's call, where a hook takes its `inputs_embeds`
    and stops it."""
    language_model = model.model.language_model

    def stop(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        raise _Embedded(kwargs["inputs_embeds"])

    hook = language_model.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            _call_with_features(model.model, input_ids, features)
    except _Embedded as embedded:
        return embedded.embeds
    finally:
        hook.remove()
    raise RuntimeError(f"{type(model.model).__name__}.forward did not call its language model")


# The classes whose forward reads their images' features as one tensor (GOT-OCR 2: `.to(...)`), not
# as a list of tensors (LLaVA: `torch.cat(...)`), as their own `get_image_features` gives them.
_TENSOR_FEATURES: weakref.WeakSet[type] = weakref.WeakSet()


def _call_with_features(inner: torch.nn.Module, input_ids: torch.Tensor, features: torch.Tensor | None) -> None:
    """`inner`'s forward with the features as its `mm_encoder_outputs`, in the form it reads: a list
    first, one tensor where a list failed (and from then on for its class)."""
    if features is None:
        inner(input_ids=input_ids)
        return
    if type(inner) not in _TENSOR_FEATURES:
        try:
            encoded = BaseModelOutputWithPooling(pooler_output=[features])
            inner(input_ids=input_ids, mm_encoder_outputs={"image": encoded})
            return
        except (AttributeError, TypeError) as error:
            if "'list'" not in str(error):
                raise
    encoded = BaseModelOutputWithPooling(pooler_output=features[None])  # ([1 image group, placeholders, hidden])
    inner(input_ids=input_ids, mm_encoder_outputs={"image": encoded})
    _TENSOR_FEATURES.add(type(inner))


class _Embedded(Exception):
    """Stops a model's forward at its language model's call, carrying the embeddings it got."""

    def __init__(self, embeds: torch.Tensor) -> None:
        super().__init__("embeddings taken")
        self.embeds = embeds


def _install_output_capturing_hooks(model: PreTrainedModel) -> None:
    """Installs the hooks by which Transformers collects the vision tower's hidden states (which
    `get_image_features` reads), as its first eager call would: installing takes a lock, which
    Dynamo cannot trace. The language model gets none (its graphs stay those of a text model)."""
    language_model = model.model.language_model
    inside = set(language_model.modules())
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module not in inside \
                and language_model not in set(module.modules()):
            maybe_install_capturing_hooks(module)
