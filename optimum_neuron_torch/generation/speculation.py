"""Speculative decoding: a request decoding alone gets several tokens from one step of the model.

At batch 1 a decode step reads every weight of the model for one token: it is bound by bytes. A
`verify` step feeds the request's last token and `k` drafted tokens after it, at their positions,
and returns the model's greedy token after each of the `k + 1` positions: the weights are read once
for them all. The drafted tokens are taken while each equals the model's token at its position; the
model's token after the last one taken comes with them. So a step gives 1 to `k + 1` tokens, each the
one greedy decoding gives: the drafts decide how many a step gives, never which.

Drafts come from (as vLLM's `--speculative-config` names its methods):

- `ngram`, prompt lookup (`NgramDrafter`): the tokens that followed the latest earlier occurrence of
  the sequence's last `n` tokens (`n` from `prompt_lookup_max` down to `prompt_lookup_min`), as
  Transformers' `prompt_lookup_num_tokens`: free, and right where the answer repeats its prompt or
  itself (code edits, extraction, summaries);
- `draft_model` (`ModelDrafter`): a smaller model of the same vocabulary decodes the `k` tokens
  greedily, on its own compiled graphs over a cache of one slot.

Graphs: a `verify` graph of one row and `k + 1` tokens per context bucket (see
`buckets.engine_plan`); a draft model's own prefills, chunks and decode steps of one row. The engine
speculates when one request decodes alone (`Speculation.step`), greedy without penalties, and whose
tokens the host does not choose (a grammar, `generate()`'s own processors); otherwise it decodes as
without speculation. The keys and values a rejected draft wrote stay past the request's position:
no query attends beyond its own position, and the next steps write over them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

import numpy
from transformers import PreTrainedModel

from ..errors import ConfigurationError
from .buckets import Buckets, engine_plan, next_piece
from .requests import NO_PENALTIES, PENALTIES, Request, SamplingSettings
from .slots import SlotSteps, dummy_step

if TYPE_CHECKING:
    from .engine import GenerationEngine

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates (the fields of vLLM's `--speculative-config` it takes).

    Args:
        method (`str`): `ngram` (prompt lookup) or `draft_model`.
        num_speculative_tokens (`int`): the tokens drafted per step, `k` (the verify graphs feed `k + 1`).
        prompt_lookup_max (`int`): `ngram`: the longest run of last tokens looked up.
        prompt_lookup_min (`int`): `ngram`: the shortest (a shorter match drafts nothing: a decode step runs).
        model (`str`, *optional*): `draft_model`: the draft model's folder or Hub id.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 2
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigurationError(f"speculative method {self.method!r} is not one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ConfigurationError(f"num_speculative_tokens must be between 1 and 64, got "
                                     f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigurationError(f"prompt_lookup_min ({self.prompt_lookup_min}) and prompt_lookup_max "
                                     f"({self.prompt_lookup_max}) must satisfy 1 <= min <= max")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigurationError("the speculative method draft_model needs `model` (the draft model's folder), "
                                     "and only it takes one")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The config of a JSON object, e.g. `{"method": "ngram", "num_speculative_tokens": 4}`.

        Raises:
            ConfigurationError: not a JSON object, a field it does not know (named), or a value out of range.
        """
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigurationError(f"--speculative-config is not JSON: {error}") from None
        if not isinstance(values, dict):
            raise ConfigurationError("--speculative-config must be a JSON object")
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigurationError(f"--speculative-config: unknown field(s) {', '.join(unknown)} (known: "
                                     f"{', '.join(sorted(known))})")
        return cls(**values)


class Drafter(Protocol):
    """What drafts tokens: `NgramDrafter` or `ModelDrafter`."""

    graphs: int  # the graphs it compiles

    def propose(self, sequence: list[int], count: int) -> list[int]:
        """At most `count` tokens likely to follow `sequence` (the prompt and the tokens taken)."""

    def warm_up(self) -> None:
        """Compiles (or loads) its graphs."""


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last
    `n` tokens, the longest `n` first (between `shortest` and `longest`)."""

    def __init__(self, longest: int, shortest: int) -> None:
        self.longest, self.shortest = longest, shortest
        self.graphs = 0

    def propose(self, sequence: list[int], count: int) -> list[int]:
        if len(sequence) < 2:
            return []
        # (where the last token occurred before: the ends of the candidate n-grams, a vectorized scan per step)
        ends = numpy.flatnonzero(numpy.asarray(sequence[:-1]) == sequence[-1])[::-1].tolist()  # (the latest first)
        for n in range(min(self.longest, len(sequence) - 1), self.shortest - 1, -1):
            for end in ends:
                if end >= n - 1 and sequence[end - n + 1:end + 1] == sequence[-n:]:
                    return sequence[end + 1:end + 1 + count]
        return []

    def warm_up(self) -> None:
        """Nothing: prompt lookup has no graph."""


class ModelDrafter:
    """A draft model's greedy tokens, from its own cache of one slot, which holds the sequence the
    last proposal saw and the drafts it fed: a proposal feeds what changed since (the tokens taken
    after the longest prefix it holds, one decode step each), or, for another sequence, prefills it
    whole (as the engine prefills a prompt), then decodes the drafts.

    Args:
        model (`PreTrainedModel`): the draft model, on the device, of the served model's vocabulary.
        buckets (`Buckets`): the engine's buckets (the draft's graphs: one row of each).
        pad_token_id (`int`): what pads its prompt pieces.
    """

    def __init__(self, model: PreTrainedModel, buckets: Buckets, pad_token_id: int) -> None:
        self.buckets = Buckets((1,), buckets.prompt_buckets, buckets.max_length, buckets.context_buckets)
        self.device = SlotSteps(model, self.buckets)
        self.pad_token_id = pad_token_id
        self.graphs = len(engine_plan(self.buckets, sampling=False))
        self.held: list[int] = []  # the tokens whose keys and values the slot holds, from position 0

    def warm_up(self) -> None:
        """Runs each of the draft's graphs once (compiled, or loaded from the compile cache)."""
        for graph in engine_plan(self.buckets, sampling=False):
            self.device.run(*dummy_step(graph, self.pad_token_id))
        self.held = []

    def propose(self, sequence: list[int], count: int) -> list[int]:
        same = 0
        for held, token in zip(self.held, sequence[:-1], strict=False):  # (the last token is never held)
            if held != token:
                break
            same += 1
        if len(sequence) - same > count + 1:  # (another request's, or far behind: prefilled again)
            token = self._prefill(sequence)
        else:
            for position in range(same, len(sequence)):
                token = self._decode(sequence[position], position)
        self.held = sequence[:]
        drafts = [token]
        while len(drafts) < count:
            self.held.append(drafts[-1])
            drafts.append(self._decode(drafts[-1], len(self.held) - 1))
        return drafts

    def _prefill(self, sequence: list[int]) -> int:
        done = 0
        while done < len(sequence):
            start, length, context = next_piece(self.buckets, done, len(sequence))
            end = min(start + length, len(sequence))
            ids = sequence[start:end] + [self.pad_token_id] * (start + length - end)
            tokens, _, _ = self.device.run([ids], [list(range(start, start + length))], end - 1 - start, context,
                                           [0.0], [SamplingSettings().row(taken=False)], 0)
            done = end
        return int(tokens[0])

    def _decode(self, token: int, position: int) -> int:
        tokens, _, _ = self.device.run([[token]], [[position]], 0, self.buckets.context_bucket_for(position + 1),
                                       [0.0], [SamplingSettings().row(taken=False)], None)
        return int(tokens[0])


class Speculation:
    """The engine's speculative decoding (see the module's docstring) and its counts.

    Args:
        config (`SpeculativeConfig`): how it drafts.
        draft_model (`PreTrainedModel`, *optional*): with `method="draft_model"`, the draft model, on the
            device (see `load_generative_model`).

    Example:

    ```python
    >>> engine = GenerationEngine(model, buckets, tokenizer, speculation=Speculation(SpeculativeConfig()))
    ```
    """

    def __init__(self, config: SpeculativeConfig, draft_model: PreTrainedModel | None = None) -> None:
        if (config.method == "draft_model") != (draft_model is not None):
            raise ConfigurationError("a draft model is given with the speculative method draft_model, and only then")
        self.config, self.draft_model = config, draft_model
        self.tokens = config.num_speculative_tokens
        self.drafter: Drafter | None = None
        self.steps = self.drafted = self.accepted = 0  # (verify steps run; tokens drafted; of those, taken)

    def bind(self, model: PreTrainedModel, buckets: Buckets, pad_token_id: int) -> int:
        """Readies its drafter for an engine of `model` and `buckets`, whose pad token is `pad_token_id`:
        the graphs it adds to the engine's (its verify graphs, a draft model's).

        Raises:
            ConfigurationError: a draft model of another vocabulary, or `k + 1` positions the cache cannot hold.
        """
        if self.tokens + 1 >= buckets.max_length:
            raise ConfigurationError(f"num_speculative_tokens {self.tokens} needs more than the {buckets.max_length} "
                                     "positions of the cache")
        if self.draft_model is None:
            self.drafter = NgramDrafter(self.config.prompt_lookup_max, self.config.prompt_lookup_min)
        else:
            vocab, draft = (m.get_input_embeddings().num_embeddings for m in (model, self.draft_model))
            if vocab != draft:
                raise ConfigurationError(f"the draft model's vocabulary has {draft} tokens, the served model's "
                                         f"{vocab}: a draft model must share its tokenizer")
            self.drafter = ModelDrafter(self.draft_model, buckets, pad_token_id)
        verify = engine_plan(buckets, sampling=False, speculative_tokens=self.tokens)
        return sum(graph.role == "verify" for graph in verify) + self.drafter.graphs

    def step(self, engine: GenerationEngine, rows: list[Request | None]) -> bool:
        """Runs a verify step instead of the decode step of `rows`, and gives its request the tokens it
        takes, if one request decodes alone and may speculate, and a draft is found: whether it ran."""
        decoding = [request for request in rows if request is not None and not request.cancelled]
        if len(decoding) != 1 or not _greedy_on_device(decoding[0]):
            return False
        request, k = decoding[0], self.tokens
        position = request.position
        room = min(k, request.max_tokens - len(request.tokens) - 1)  # (tokens past its last are never taken)
        if room < 1 or position + k >= engine.buckets.max_length:
            return False
        drafts = self.drafter.propose(request.prompt + request.tokens, room)
        if not drafts:
            return False
        ids = [request.tokens[-1], *drafts] + [engine.pad_token_id] * (k - len(drafts))
        tokens, logits, _ = engine.device.forward(
            [ids], [list(range(position, position + k + 1))], 0, engine.buckets.context_bucket_for(position + k + 1),
            [0.0], [request.row(taken=False)], request._slot, verify=True)
        greedy = tokens.tolist()
        taken = 0
        while taken < len(drafts) and drafts[taken] == greedy[taken]:
            taken += 1
        self.steps, self.drafted, self.accepted = self.steps + 1, self.drafted + len(drafts), self.accepted + taken
        for index, token in enumerate(greedy[:taken + 1]):
            engine._take(request, request.chosen(token, logits[index]))
            if request.cancelled:
                break
        return True


def _greedy_on_device(request: Request) -> bool:
    """Whether `request`'s tokens are the argmax of its raw logits: greedy, no penalty, none chosen on the host."""
    settings = request.sampling.row()  # (as the step reads it: a temperature of 0 takes the argmax)
    return settings[0] == 0 and settings[PENALTIES] == NO_PENALTIES and request.choose is None

