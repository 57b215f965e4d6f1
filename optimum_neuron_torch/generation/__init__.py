"""Compiled generation: `generate()` on a fixed set of static-shape graphs, cached on disk.

Models returned by `NeuronAutoModelForCausalLM` and `NeuronAutoModelForSeq2SeqLM` have it;
`enable_compiled_generation(model)` gives it to any Transformers generative model on the device.
"""

from .buckets import Buckets, PlannedGraph, describe_plan, graph_plan
from .mixin import NeuronGenerationMixin, disable_compiled_generation, enable_compiled_generation

__all__ = [
    "Buckets", "NeuronGenerationMixin", "PlannedGraph", "describe_plan", "disable_compiled_generation",
    "enable_compiled_generation", "graph_plan",
]
