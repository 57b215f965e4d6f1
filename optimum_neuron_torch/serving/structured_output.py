"""Structured output: answers held to a JSON schema (`response_format`), by llguidance's grammars.

A request whose `response_format` is `json_object` or `json_schema` has each of its tokens chosen on
the host (`Request.choose`), from its row's raw logits (float32), in the order the compiled step
applies what it applies: the request's penalties (`sampling.penalize`, the same code), then every
token the grammar does not allow next dropped (llguidance's bitmask for the matcher's state), then
the argmax, or a draw with the request's warpers, as the step draws (`sampling.sample`, the same
code, from the request's own generator). So wherever the grammar allows what the model would have
said, the answer is what it would have been; it always parses; and once the grammar is complete,
only an end-of-sequence token is allowed. The device runs such a row as a greedy one and its token
is not taken: no graph of its own (the graphs are those of every request). A request with a
`logit_bias` is chosen on the host the same way, its bias added to the logits first.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InvalidRequestError, MissingDependencyError
from ..generation.requests import PENALTIES, WARPERS, SamplingSettings
from ..generation.sampling import penalize, sample

# JSON as compact as `json.dumps(..., separators=(",", ":"))` writes it, strings and numbers in any form the schema
# allows: what the compiler of the grammar does by default (a small model given free whitespace may run on in it).
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_CACHED_SCHEMAS = 256  # the compiled schemas kept (a client sends the same tools with each request)


class Grammars:
    """The grammars of one model's answers: llguidance's view of its tokenizer (built on first use:
    a pass over the vocabulary), and a matcher per answer.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): the model's tokenizer (a fast one).
        vocab (`int`): the width of the model's logits (may exceed the tokenizer's vocabulary).
        eos_token_ids (`Sequence[int]`): the tokens that end an answer, the only ones allowed once
            its grammar is complete.
    """

    def __init__(self, tokenizer: Any, vocab: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab, self.eos_token_ids = tokenizer, vocab, sorted(eos_token_ids)
        self._llguidance_tokenizer = None
        self._schemas: dict[tuple[str, bool], str] = {}  # (the latest `MAX_CACHED_SCHEMAS`, compiled once each)

    def grammar(self, response_format: dict[str, Any] | None, field: str = "response_format") -> str | None:
        """The grammar a `response_format` (as the OpenAI API gives it) holds answers to, or None
        (`text`, or none given): llguidance's, checked against the tokenizer.

        Raises:
            InvalidRequestError: a schema the grammar's compiler does not take (names the field).
            MissingDependencyError: llguidance is not installed.
        """
        kind = (response_format or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return self.schema({"type": "object"}, f"{field}.type")
        if not response_format.get("json_schema"):
            raise InvalidRequestError(f"{field}.json_schema: required with the type json_schema",
                                      f"{field}.json_schema")
        return self.schema(response_format["json_schema"].get("schema") or {}, f"{field}.json_schema.schema")

    def schema(self, schema: dict[str, Any], field: str, for_answers: bool = True) -> str:
        """The grammar of the JSON values `schema` (a JSON schema) allows, checked against the
        tokenizer if answers are to be held to it (`for_answers`), else on its own.

        Raises:
            InvalidRequestError: a schema the grammar's compiler does not take, or (`for_answers`) a
                tokenizer llguidance cannot read (names `field`).
            MissingDependencyError: llguidance is not installed.
        """
        key = (json.dumps(schema, sort_keys=True), for_answers)
        if key in self._schemas:
            return self._schemas[key]
        matcher = _llguidance().LLMatcher
        refused = f"{field}: not a JSON schema the grammar compiler takes"
        try:
            grammar = matcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as error:  # (llguidance raises on a schema it cannot read at all)
            raise InvalidRequestError(f"{refused}: {error}", field) from None
        tokenizer = None
        if for_answers:
            try:
                tokenizer = self._tokenizer()
            except ValueError as error:  # (llguidance reads byte-level BPE and SentencePiece tokenizers)
                raise InvalidRequestError(f"{field}: this model's tokenizer is not one the grammar library "
                                          f"(llguidance) reads, so answers cannot be held to a grammar: {error}",
                                          field) from None
        failed, messages = matcher.validate_grammar_with_warnings(grammar, tokenizer)
        if failed:
            raise InvalidRequestError(f"{refused}: {messages[0]}", field)
        if len(self._schemas) >= MAX_CACHED_SCHEMAS:
            self._schemas.pop(next(iter(self._schemas)))  # (the oldest)
        self._schemas[key] = grammar
        return grammar

    def sampler(self, grammar: str | None, sampling: SamplingSettings, prompt: list[int],
                bias: dict[int, float] | None = None) -> GrammarSampler:
        """What chooses the tokens of one answer held to `grammar` (a matcher of its own), if any, with
        `bias` (`logit_bias`) added to its logits."""
        matcher = None if grammar is None else _llguidance().LLMatcher(self._tokenizer(), grammar)
        return GrammarSampler(matcher, sampling, prompt, self.vocab, bias)

    def _tokenizer(self) -> Any:
        if self._llguidance_tokenizer is None:
            self._llguidance_tokenizer = _llguidance().hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab,
                                                                          eos_token=self.eos_token_ids)
        return self._llguidance_tokenizer


class GrammarSampler:
    """Chooses the tokens of one answer held to a grammar (see the module's docstring), or given a
    `logit_bias`: a `Request.choose`, called with the row's float32 logits `[vocab]` and the
    request's generator.

    Args:
        matcher (`llguidance.LLMatcher`, *optional*): the answer's matcher, at its start (None: no grammar).
        sampling (`SamplingSettings`): the request's penalties and warpers.
        prompt (`list[int]`): its prompt (what the repetition penalty reads with the answer).
        vocab (`int`): the width of the logits.
        bias (`dict[int, float]`, *optional*): added to the logits of these tokens first, as the
            OpenAI API's `logit_bias`.
    """

    def __init__(self, matcher: Any, sampling: SamplingSettings, prompt: list[int], vocab: int,
                 bias: dict[int, float] | None = None) -> None:
        row = sampling.row()
        self.matcher, self.greedy = matcher, sampling.temperature == 0
        self.penalties, self.warpers = torch.tensor([row[PENALTIES]]), torch.tensor([row[WARPERS]])
        self.seen, self.counts = torch.zeros((1, vocab)), torch.zeros((1, vocab))
        self.seen[0, prompt] = 1.0
        self.bias = torch.zeros(vocab)
        if bias:
            self.bias[list(bias)] = torch.tensor(list(bias.values()))
        self.guidance = None if matcher is None else _llguidance().torch
        self.bitmask = None if matcher is None else self.guidance.allocate_token_bitmask(1, vocab)

    def __call__(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        """The next token; the matcher takes it.

        Raises:
            RuntimeError: the matcher refused it (its error named): the request fails.
        """
        scores = penalize((logits + self.bias)[None], self.penalties, self.seen, self.counts)
        if self.matcher is not None:
            self.guidance.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
            self.guidance.apply_token_bitmask_inplace(scores, self.bitmask)
        if self.greedy:
            token = int(scores.argmax(-1))
        else:
            token = int(sample(scores, self.warpers, torch.rand(1, generator=generator)))
        if self.matcher is not None and not self.matcher.consume_token(token):
            raise RuntimeError(f"the answer's grammar refused token {token}: {self.matcher.get_error()}")
        self.seen[0, token] = 1.0
        self.counts[0, token] += 1.0
        return token


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        raise MissingDependencyError("structured output (response_format) needs llguidance: "
                                     "pip install 'optimum-neuron-torch[serve]'") from None
    return llguidance
