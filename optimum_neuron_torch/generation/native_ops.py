"""Native kernels for the ops that Transformers' decoding loop needs and TorchNeuron lacks.

Greedy and sampled `generate()` call `argmax`, `isin` (stopping criteria), `sort` (top-p) and
`multinomial`, none of which TorchNeuron runs natively: each decoding step would take the CPU
fallback. Inside `native_generation_ops()` they run as compositions of native ops instead
(`max.dim`, `eq`/`any`, `topk`, `cumsum`/`log`), registered for the device through
`torch.library` and removed when the block ends. Random numbers for `multinomial` are drawn on
the host (TorchNeuron has no native RNG op) from the generator given, or the default one that
`torch.manual_seed` seeds, so sampling is reproducible.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

DEVICE_KEY = "PrivateUse1"


def argmax(self: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """`argmax` as `max.dim`, which returns the first maximal index too."""
    if dim is None:
        index = torch.ops.aten.max.dim(self.reshape(-1), 0)[1]
        return index.reshape([1] * self.dim()) if keepdim else index
    return torch.ops.aten.max.dim(self, dim, keepdim)[1]


def isin(elements: torch.Tensor, test_elements: torch.Tensor, *, assume_unique: bool = False,
         invert: bool = False) -> torch.Tensor:
    """`isin` as one broadcast comparison: fine for the few stop tokens generation tests."""
    found = (elements.unsqueeze(-1) == test_elements.reshape(-1)).any(-1)
    return found.logical_not() if invert else found


def sort(self: torch.Tensor, dim: int = -1, descending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`sort` as a full `topk`; equal values may come out in another order than a stable sort's."""
    if self.dim() == 0:
        return self.clone(), torch.zeros((), dtype=torch.long, device=self.device)
    return torch.topk(self, self.size(dim), dim=dim, largest=descending, sorted=True)


def sort_stable(self: torch.Tensor, *, stable: bool | None = None, dim: int = -1,
                descending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return sort(self, dim, descending)


def _uniform(shape: torch.Size, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Uniform [0, 1) numbers drawn on the host (or on the generator's device) and moved to `like`'s."""
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(shape, dtype=torch.float32, device=device, generator=generator).to(like.device)


def multinomial(self: torch.Tensor, num_samples: int, replacement: bool = False, *,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Categorical sampling from native ops: one draw (what generation takes each step), or draws
    with replacement, as the inverse of the cumulative distribution: one uniform number per draw
    crosses from the host (4 bytes a sequence a step, where a number per token of the vocabulary
    would be the logits' size); several draws without replacement as the top `num_samples` of
    `probs / Exp(1)` (the exponential race torch's own kernel uses)."""
    probs = self.float()
    if not replacement and num_samples > 1:
        race = probs / _uniform(probs.shape, probs, generator).log().neg()
        return torch.topk(race, num_samples, dim=-1).indices
    cumulative = probs.cumsum(-1)
    targets = _uniform((*probs.shape[:-1], num_samples), probs, generator) * cumulative[..., -1:]
    below = (cumulative.unsqueeze(-2) <= targets.unsqueeze(-1)).sum(-1)
    return below.clamp_max(probs.size(-1) - 1)


KERNELS = {
    "argmax": argmax,
    "isin.Tensor_Tensor": isin,
    "sort": sort,
    "sort.stable": sort_stable,
    "multinomial": multinomial,
}

_lock = threading.Lock()
_users = 0
_library: torch.library.Library | None = None


@contextlib.contextmanager
def native_generation_ops() -> Iterator[None]:
    """A context manager inside which `argmax`, `isin`, `sort` and `multinomial` run on the `neuron`
    device as compositions of native ops instead of taking the CPU fallback: the ops Transformers'
    decoding loop needs (greedy and sampled `generate()`) and TorchNeuron lacks. The kernels are
    registered for the device through `torch.library` on entry and removed on exit; nested blocks,
    in any thread, share one registration. The library's own `generate()` enters it.

    Sampling draws its random numbers on the host, from the generator given to `multinomial` or the
    default one (`torch.manual_seed` seeds it), so it is reproducible.

    Returns:
        The context manager (it yields nothing).

    Raises:
        Nothing of its own: inside the block the ops raise what their native compositions raise.

    Example:

    ```python
    >>> import torch
    >>> import optimum_neuron_torch as ont

    >>> scores = torch.randn(2, 32000, device="neuron")
    >>> with ont.native_generation_ops(), ont.fallback_policy("error"):
    ...     next_tokens = scores.argmax(-1)  # no fallback: runs as `max.dim` on the device
    ```
    """
    global _users, _library
    with _lock:
        if _users == 0:
            _library = torch.library.Library("aten", "IMPL")
            for op, kernel in KERNELS.items():
                _library.impl(op, kernel, DEVICE_KEY)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                _library._destroy()
                _library = None
