"""Compiled generation: `generate()` on a fixed set of static-shape graphs, cached on disk.

Models returned by `NeuronAutoModelForCausalLM` and `NeuronAutoModelForSeq2SeqLM` have it;
`enable_compiled_generation(model)` gives it to any Transformers generative model on the device.
"""

from .buckets import Buckets
from .mixin import NeuronGenerationMixin, disable_compiled_generation, enable_compiled_generation

__all__ = ["Buckets", "NeuronGenerationMixin", "disable_compiled_generation", "enable_compiled_generation"]
