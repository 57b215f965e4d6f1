"""`dense_embeddings`: embeddings built with `sparse=True` get dense gradients (same forward, same
gradient values), as TorchNeuron has no sparse tensors."""

from __future__ import annotations

from torch import nn

from .registry import ModelPatch, Undo


def _sparse_embeddings(model: nn.Module) -> list[nn.Embedding | nn.EmbeddingBag]:
    return [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]


def _densify_embeddings(model: nn.Module) -> Undo:
    modules = _sparse_embeddings(model)
    for module in modules:
        module.sparse = False

    def undo() -> None:
        for module in modules:
            module.sparse = True

    return undo


PATCH = ModelPatch(
    name="dense_embeddings",
    description="Embeddings built with sparse=True get dense gradients (same forward, same gradient values): "
                "TorchNeuron has no sparse tensors.",
    architectures=(),  # no Transformers 5.24 architecture builds sparse embeddings; custom models do
    applies=lambda model: bool(_sparse_embeddings(model)),
    apply=_densify_embeddings,
)
