"""Sampling in the compiled decode step.

Transformers' loop samples on the host: each step moves the logits row to the host (4 bytes per
vocabulary entry), applies the logits warpers and draws the token with `torch.multinomial`. When
the warpers of a call are only those a graph holds (temperature, top-k, top-p and min-p, as
Transformers builds them from the generation config), the compiled decode step applies them to the
logits and draws the token itself, from a uniform number the host draws from torch's default
generator (so `torch.manual_seed` makes sampled sequences reproducible, and ranks that share the
random state draw the same tokens); only the token crosses back. The parameters are per-row
tensors: one graph serves every temperature, top-k, top-p and min-p. The server's step also
applies penalties for the tokens a sequence holds (`penalize`), from counts it keeps on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.generation import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# The warpers a graph applies, in the order Transformers applies them (`_get_logits_processor`).
GRAPH_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


@dataclass(frozen=True)
class SamplingParameters:
    """What the decode graph samples with: Transformers' warpers' parameters.

    Args:
        temperature (`float`): the logits are divided by it.
        top_k (`int`): tokens scoring below the `top_k`-th largest score are dropped (0: none).
        top_p (`float`): tokens outside the smallest set of the largest probabilities that sum above
            `top_p` are dropped (1.0: none).
        min_tokens_to_keep (`int`): top-p and min-p keep at least this many tokens.
        min_p (`float`): tokens whose probability is below `min_p` times the largest one are dropped
            (0.0: none).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_tokens_to_keep: int = 1
    min_p: float = 0.0

    @classmethod
    def of(cls, processors: LogitsProcessorList) -> SamplingParameters | None:
        """The parameters of `processors` if the graph can apply them all (Transformers' temperature,
        top-k, top-p and min-p warpers, each at most once, in Transformers' order, dropping tokens to
        -inf, top-p and min-p keeping as many tokens), else None."""
        kinds = [type(processor) for processor in processors]
        if any(kind not in GRAPH_WARPERS for kind in kinds) or kinds != sorted(set(kinds), key=GRAPH_WARPERS.index):
            return None
        if any(getattr(processor, "filter_value", -math.inf) != -math.inf for processor in processors):
            return None
        if len({processor.min_tokens_to_keep for processor in processors
                if isinstance(processor, TopPLogitsWarper | MinPLogitsWarper)}) > 1:
            return None
        parameters = {}
        for processor in processors:
            if isinstance(processor, TemperatureLogitsWarper):
                parameters["temperature"] = float(processor.temperature)
            elif isinstance(processor, TopKLogitsWarper):
                parameters["top_k"] = int(processor.top_k)
            elif isinstance(processor, TopPLogitsWarper):
                parameters.update(top_p=float(processor.top_p), min_tokens_to_keep=int(processor.min_tokens_to_keep))
            else:
                parameters.update(min_p=float(processor.min_p), min_tokens_to_keep=int(processor.min_tokens_to_keep))
        return cls(**parameters)

    def row(self) -> list[float]:
        """The parameters as a row of the tensor the graph takes (see `rows`)."""
        return [self.temperature, self.top_k, self.top_p, self.min_tokens_to_keep, self.min_p]

    def rows(self, rows: int) -> torch.Tensor:
        """The parameters as the graph takes them: float32 `[rows, 5]` (temperature, top-k, top-p,
        tokens to keep, min-p; the integers are exact in float32 up to 2**24)."""
        return torch.tensor([self.row()] * rows, dtype=torch.float32)


def sample(logits: torch.Tensor, parameters: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """In the compiled step: one token per row of `logits` `[rows, vocab]`, drawn from the
    distribution Transformers' warpers and softmax give (`parameters` from `SamplingParameters.rows`),
    by inverting its cumulative distribution at `uniform` `[rows]` (in [0, 1))."""
    temperature, top_k, top_p, keep, min_p = parameters.unbind(-1)
    scores = logits.float() / temperature[:, None]
    vocab = scores.shape[-1]
    values, indices = scores.topk(vocab)  # (descending: every warper reads ranks)
    # Top-k: scores below the k-th largest are dropped (ties with it are kept, as Transformers does).
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).long()
    values = values.masked_fill(values < values.gather(-1, k[:, None] - 1), -math.inf)
    # Top-p, computed as Transformers does: cumulative probabilities in ascending order, tokens at
    # or below 1 - top_p dropped, the `keep` largest always kept.
    cumulative = values.flip(-1).softmax(-1).cumsum(-1).flip(-1)
    rank = torch.arange(vocab, device=values.device)
    dropped = (cumulative <= 1 - top_p[:, None]) & (rank >= keep[:, None]) & (top_p[:, None] < 1)
    values = values.masked_fill(dropped, -math.inf)
    # Min-p, on what top-p kept: probabilities below `min_p` times the largest (the first) dropped.
    probabilities = values.softmax(-1)
    dropped = (probabilities < min_p[:, None] * probabilities[:, :1]) & (rank >= keep[:, None])
    probabilities = values.masked_fill(dropped, -math.inf).softmax(-1)
    # The first token whose cumulative probability exceeds the uniform draw: the tokens of nonzero
    # probability come first, and the draw never passes the last of them (where `uniform * total`
    # rounds to the total).
    cdf = probabilities.cumsum(-1)
    chosen = torch.minimum((cdf <= uniform[:, None] * cdf[:, -1:]).sum(-1), (probabilities > 0).sum(-1) - 1)
    return indices.gather(-1, chosen[:, None]).squeeze(-1)


def penalize(logits: torch.Tensor, penalties: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """In the compiled step: `logits` `[rows, vocab]` with each row's penalties `[rows, 3]` applied
    (repetition, presence, frequency; 1, 0, 0 change nothing). The repetition penalty is
    Transformers' (`RepetitionPenaltyLogitsProcessor`: scores of the tokens the sequence holds,
    prompt included (`seen`, 0 or 1), divided by it if positive, else multiplied); presence and
    frequency are the OpenAI API's (minus `presence` for each token generated at least once, minus
    `frequency` times the times it was (`counts`))."""
    repetition, presence, frequency = penalties.unbind(-1)
    logits = logits.float()
    repeated = torch.where(logits < 0, logits * repetition[:, None], logits / repetition[:, None])
    logits = torch.where(seen > 0, repeated, logits)
    return logits - presence[:, None] * (counts > 0) - frequency[:, None] * counts
