"""Keeping unsupported ops working: the fallback policy (what happens when an op has no native
kernel on the `neuron` device). Model patches live in `optimum_neuron_torch.patches`, the native
decoding ops in `optimum_neuron_torch.generation.native_ops`."""

from .policy import fallback_policy, get_fallback_policy, set_fallback_policy, watch

__all__ = ["fallback_policy", "get_fallback_policy", "set_fallback_policy", "watch"]
