"""MegaCache integration: `torch.compiler.save_cache_artifacts()` carries the NEFFs of the `neuron`
backend, and `load_cache_artifacts()` puts them back in the NEFF cache, as TorchNeuron's does.
"""

from __future__ import annotations

import logging
from enum import Enum

from torch.compiler._cache import (
    CacheArtifact,
    CacheArtifactFactory,
    CacheArtifactManager,
)

import torch_neuronx
from torch_neuronx.neuron_dynamo_backend import _neff_cache

logger = logging.getLogger(__name__)


class ArtifactType(Enum):
    """MegaCache artifact types of the Neuron compilation caches."""

    NEURON_NEFF = "neuron_neff"


@CacheArtifactFactory.register
class NeuronNeffCacheArtifact(CacheArtifact):
    """A compiled NEFF, keyed by its persistent cache key."""

    @staticmethod
    def type() -> str:
        return ArtifactType.NEURON_NEFF.value

    def populate_cache(self) -> None:
        """Writes the NEFF to the cache during load_cache_artifacts(); a failure only warns, as in torch."""
        if not _neff_cache.put(self.key, self.content):
            logger.warning(f"Failed to write NEFF to persistent cache: {self.key}")


def _collect_neuron_artifacts() -> None:
    """Records every NEFF compiled or hit since the last collection as a MegaCache artifact."""
    for key in _neff_cache.take_tracked():
        content = _neff_cache.get(key)
        if content is not None:
            CacheArtifactManager.record_artifact(ArtifactType.NEURON_NEFF.value, key, content)


_original_serialize = CacheArtifactManager.serialize.__func__


def _wrapped_serialize(cls):
    """Collects the Neuron artifacts just before torch serializes the artifacts."""
    torch_neuronx.synchronize()
    _collect_neuron_artifacts()
    return _original_serialize(cls)


CacheArtifactManager.serialize = classmethod(_wrapped_serialize)
