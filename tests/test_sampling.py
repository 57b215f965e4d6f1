"""Sampling in the compiled decode step: the distribution of Transformers' warpers, drawn by inverse
distribution function from the host's uniform numbers."""

from __future__ import annotations

import pytest
import torch
from transformers.generation import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from optimum_neuron_torch.generation.sampling import SamplingParameters, penalize, sample

VOCAB = 97


def warpers(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, keep: int = 1,
            min_p: float = 0.0) -> LogitsProcessorList:
    """The warpers Transformers' `_get_logits_processor` builds for these settings, in its order."""
    processors = LogitsProcessorList()
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k, min_tokens_to_keep=keep))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p, min_tokens_to_keep=keep))
    if min_p:
        processors.append(MinPLogitsWarper(min_p, min_tokens_to_keep=keep))
    return processors


@pytest.mark.parametrize("settings", [
    dict(),
    dict(temperature=0.7),
    dict(top_k=5),
    dict(top_p=0.8),
    dict(temperature=1.3, top_k=20, top_p=0.9),
    dict(temperature=0.5, top_p=0.3, keep=3),
    dict(top_k=1),
    dict(top_k=VOCAB + 10),
    dict(min_p=0.1),
    dict(temperature=0.8, top_p=0.9, min_p=0.05, keep=2),
    dict(min_p=1.0, keep=3),
])
def test_each_token_is_drawn_where_transformers_distribution_puts_it(settings):
    """For uniform numbers at the middle of each token's share of the cumulative distribution of
    Transformers' warped probabilities (tokens by decreasing probability), the step draws that token;
    tokens the warpers drop are never drawn."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    processors = warpers(**settings)
    parameters = SamplingParameters.of(processors)
    assert parameters is not None
    probabilities = processors(None, logits.clone()).softmax(-1).double()
    for row in range(len(logits)):
        order = probabilities[row].argsort(descending=True, stable=True)
        shares = probabilities[row][order]
        kept = int((shares > 0).sum())
        cumulative = shares.cumsum(0)
        # (tokens whose share a float32 uniform number can single out)
        tested = int((shares[:kept] > 1e-5).sum())
        middles = (cumulative[:tested] - shares[:tested] / 2).float()
        drawn = sample(logits[row:row + 1].expand(tested, -1), parameters.rows(tested), middles)
        assert drawn.tolist() == order[:tested].tolist()
        # (the ends of the uniform numbers draw the most likely token and a kept one, never a dropped one,
        # even at 1, which `torch.rand` does not draw but `uniform * total` can round to)
        ends = sample(logits[row:row + 1].expand(3, -1), parameters.rows(3), torch.tensor([0.0, 1 - 2**-24, 1.0]))
        assert ends[0] == order[0] and ends[1] in order[:kept] and ends[2] in order[:kept]


def test_only_the_warpers_the_graph_applies_are_taken():
    assert SamplingParameters.of(LogitsProcessorList()) == SamplingParameters()
    assert SamplingParameters.of(warpers(0.7, 5, 0.9, keep=2)) == SamplingParameters(0.7, 5, 0.9, 2)
    assert SamplingParameters.of(warpers(0.7, min_p=0.1)) == SamplingParameters(0.7, min_p=0.1)
    for processors in (
        [RepetitionPenaltyLogitsProcessor(1.3)],
        [MinPLogitsWarper(0.1), TopPLogitsWarper(0.9)],  # (another order: another distribution)
        [TopPLogitsWarper(0.9), TemperatureLogitsWarper(0.7)],
        [TopPLogitsWarper(0.9, min_tokens_to_keep=2), MinPLogitsWarper(0.1)],  # (one count of tokens to keep)
        [TopKLogitsWarper(5), TopKLogitsWarper(3)],
        [TopKLogitsWarper(5, filter_value=-1e4)],
    ):
        assert SamplingParameters.of(LogitsProcessorList(processors)) is None


def test_penalties_are_transformers_repetition_penalty_and_the_openai_apis():
    """`penalize` gives the scores of Transformers' repetition penalty over the tokens a row holds,
    then subtracts the OpenAI API's presence and frequency penalties for the tokens it generated."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=generator) * 3
    prompt = torch.randint(VOCAB, (3, 6), generator=generator)
    generated = torch.randint(VOCAB, (3, 9), generator=generator)
    held = torch.cat([prompt, generated], 1)
    seen = torch.zeros(3, VOCAB).scatter(1, held, 1.0)
    counts = torch.zeros(3, VOCAB).scatter_add(1, generated, torch.ones(3, 9))
    penalties = torch.tensor([[1.3, 0.0, 0.0], [1.0, 0.5, 0.25], [0.7, -1.0, 1.5]])
    out = penalize(logits, penalties, seen, counts)
    for row, (repetition, presence, frequency) in enumerate(penalties.tolist()):
        wanted = RepetitionPenaltyLogitsProcessor(repetition)(held[row:row + 1], logits[row:row + 1].clone())[0]
        wanted = wanted - presence * (counts[row] > 0) - frequency * counts[row]
        torch.testing.assert_close(out[row], wanted, rtol=0, atol=1e-6)
    assert torch.equal(penalize(logits, torch.tensor([[1.0, 0.0, 0.0]] * 3), seen, counts), logits)
