"""What the serving engine serves: a request, how it samples, and the events it produces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidRequestError
from .sampling import SamplingParameters
from .text import TextStream

# The columns of a row of the step's sampling tensor (`SamplingSettings.row`): the warpers'
# parameters (`SamplingParameters.row`), the penalties, whether the row's token is taken.
WARPERS = slice(0, len(SamplingParameters().row()))
PENALTIES = slice(WARPERS.stop, WARPERS.stop + 3)  # repetition, presence, frequency
TAKEN = PENALTIES.stop
ADAPTER = TAKEN + 1  # the row's LoRA adapter's slot (0: none; see `lora_adapters`): the host's, not sent
NO_PENALTIES = [1.0, 0.0, 0.0]  # the logits as they are
# The most likely tokens a request may ask the log-probabilities of, with each token's (as the OpenAI
# API's chat `top_logprobs`); the graphs that score a prompt compute that many at each position.
MAX_LOGPROBS = 20


@dataclass
class SamplingSettings:
    """How a request chooses its tokens: greedy when `temperature` is 0, else sampled with these
    warpers (as Transformers' temperature, top-k, top-p and min-p warpers apply them); greedy or
    not, after the penalties (see `generation.sampling.penalize`).

    Args:
        temperature (`float`): 0 for greedy decoding.
        top_p (`float`): nucleus sampling (1.0: off).
        top_k (`int`): the k most likely tokens only (0: off).
        min_p (`float`): tokens less likely than `min_p` times the most likely one are dropped (0: off).
        repetition_penalty (`float`): Transformers' penalty of the tokens the prompt and answer hold (1: off).
        presence_penalty (`float`): subtracted from the logits of tokens generated so far (0: off).
        frequency_penalty (`float`): subtracted per time a token was generated (0: off).
        seed (`int` or `None`): makes the sampled tokens reproducible, whatever else is running.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def row(self, taken: bool = True) -> list[float]:
        """The row of the step's sampling tensor (see `slots.slot_step`; its columns: `WARPERS`,
        `PENALTIES`, `TAKEN`, `ADAPTER`: none)."""
        warpers = SamplingParameters(self.temperature, self.top_k, self.top_p, 1, self.min_p).row()
        return [*warpers, self.repetition_penalty, self.presence_penalty, self.frequency_penalty, float(taken), 0.0]


@dataclass(frozen=True)
class TokenLogprob:
    """A token taken, its log-probability under the model (its raw logits, before penalties and
    warpers, as vLLM and the OpenAI API give them), and the most likely tokens with theirs."""

    token: int
    logprob: float | None  # (None: a prompt's first token, which nothing before predicts)
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Event:
    """What a request produced in one step: the text released (maybe empty), how many tokens it has
    generated so far, and, on its last event, why it finished (`stop` or `length`, as the OpenAI API
    names them); with `Request.logprobs`, the log-probabilities of the tokens taken in the step."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None
    error: str | None = None  # (with finish_reason "error": what failed)
    logprobs: list[TokenLogprob] | None = None
    # (the first event, with `Request.prompt_logprobs`: the prompt's tokens)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(eq=False)
class Request:
    """One generation request of the engine.

    Args:
        prompt (`list[int]`): the prompt's token ids.
        max_tokens (`int` or `None`): the most tokens to generate (None: as many as the cache holds
            after the prompt; `submit` sets it).
        sampling (`SamplingSettings`): greedy or sampled.
        stop (`list[str]`): stop strings (the text ends before the first one met).
        on_event (`Callable[[Event], None]`): called, on the thread running the device, with each
            step's `Event`; the last one has a `finish_reason`.
        eos_token_ids (`set[int]`, *optional*): the tokens that end it (default: the model's
            generation config's).
        choose (`Callable[[torch.Tensor, torch.Generator], int]`, *optional*): chooses each token on
            the host, given the row's float32 logits (`[vocab]`) and the request's generator (seeded
            by `sampling.seed`), for logits processors the device does not apply (a `generate()` call's,
            see `engine_calls`); `sampling` then stays greedy on the device. Default: the device's token.
        logprobs (`int`, *optional*): each event carries the log-probability of each token taken and
            of the `logprobs` most likely ones (computed on the host from the row's logits: a copy of
            `[vocab]` floats per token). Default: none.
        prompt_logprobs (`int`, *optional*): the first event also carries the log-probability of
            each prompt token given those before it (None for the first), with the `prompt_logprobs`
            most likely ones (at most `MAX_LOGPROBS`), computed by the engine's scoring graphs (see
            `buckets.engine_plan`). Default: none.
        adapter (`int`): the slot of the LoRA adapter it runs with (set by `AdapterSlots.use`); 0: none.
        images (`torch.Tensor`, *optional*): a vision-language model's pixel values of the images
            whose placeholders the prompt holds, in their order (its processor's `pixel_values`).
    """

    prompt: list[int]
    max_tokens: int | None
    sampling: SamplingSettings
    stop: list[str]
    on_event: Callable[[Event], None]
    eos_token_ids: set[int] | None = None
    choose: Callable[[torch.Tensor, torch.Generator], int] | None = field(default=None, repr=False)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    adapter: int = 0
    images: torch.Tensor | None = field(default=None, repr=False)
    cancelled: bool = False  # ended: done, failed, or its caller gone
    tokens: list[int] = field(default_factory=list)  # generated so far
    error: BaseException | None = field(default=None, repr=False)  # what failed it, if anything did
    # The engine's, once the request has a slot: its text so far, its random numbers, its slot.
    _text: TextStream | None = field(default=None, init=False, repr=False)
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)
    _slot: int | None = field(default=None, init=False, repr=False)
    _prefilled: int = field(default=0, init=False, repr=False)  # prompt tokens in the cache so far
    _features: torch.Tensor | None = field(default=None, init=False, repr=False)  # its images', on the device
    _call: list[Request] = field(default_factory=list, init=False, repr=False)  # its `generate()` call's requests
    _logprobs: list[TokenLogprob] = field(default_factory=list, init=False, repr=False)  # (for the next event)
    _prompt_logprobs: list[TokenLogprob] = field(default_factory=list, init=False, repr=False)

    def check(self, max_length: int, prompt_field: str = "prompt", scoring: bool = False, images: Any = None
              ) -> None:
        """Checks the prompt and `max_tokens` against a cache of `max_length` positions per slot, and
        sets `max_tokens` if None (to the room the cache leaves after the prompt); the images against
        the prompt's placeholders (`images`: a vision-language model's `images.ImageEncoder`, which
        knows its placeholder token and the features per image; None for a model of text).

        Raises:
            InvalidRequestError: an empty prompt, a prompt with no room for an answer, `max_tokens`
                beyond what the cache holds after the prompt (names the field), `prompt_logprobs`
                without `scoring` (an engine that has no graph to score prompts with), images for a
                model of text, or image placeholders that are not those of the images.
        """
        if self.images is not None or images is not None:
            self._check_images(images, prompt_field)
        if self.prompt_logprobs is not None and not scoring:
            raise InvalidRequestError("scoring the prompt needs the graphs that score it: start the server with "
                                      "--prompt-logprobs (an engine with scoring=True)", "prompt_logprobs")
        prompt = self.prompt
        if not prompt:
            raise InvalidRequestError("the prompt has no tokens", prompt_field)
        if len(prompt) > max_length - 1:
            raise InvalidRequestError(f"the prompt has {len(prompt)} tokens, above the {max_length - 1} this "
                                      f"server takes (its {max_length} positions, --max-length, less one "
                                      "for the answer); shorten it, or start the server with a larger --max-length",
                                      prompt_field)
        room = max_length - len(prompt)
        if self.max_tokens is None:
            self.max_tokens = room
        elif self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        elif self.max_tokens > room:
            raise InvalidRequestError(f"max_tokens is {self.max_tokens}, but the prompt's {len(prompt)} tokens leave "
                                      f"room for {room} in this server's {max_length} positions (--max-length)",
                                      "max_tokens")

    def _check_images(self, encoder: Any, prompt_field: str) -> None:
        if encoder is None:
            raise InvalidRequestError("this model reads no images", prompt_field)
        images = 0 if self.images is None else self.images.shape[0]
        placeholders, expected = self.prompt.count(encoder.image_token), images * encoder.tokens_per_image
        if placeholders != expected and (encoder.tokens_per_image or not images):  # (0: not known yet)
            raise InvalidRequestError(f"the prompt holds {placeholders} image placeholder tokens where its {images} "
                                      f"image(s) need {expected} ({encoder.tokens_per_image} each): let the model's "
                                      "processor expand each image's placeholder", prompt_field)

    def image_features(self, start: int, end: int, image_token: int | None) -> torch.Tensor | None:
        """The features of the image placeholders among `prompt[start:end]` (None: none there)."""
        inside = self.prompt[start:end].count(image_token) if self._features is not None else 0
        if not inside:
            return None
        before = self.prompt[:start].count(image_token)
        return self._features[before:before + inside]

    def begin(self, tokenizer: Any, images: Any, batch_sizes: tuple[int, ...]) -> None:
        """Readies its text stream (with `tokenizer`, if any), its random numbers (seeded by
        `sampling.seed`, else at random) and its images' features (by `images`, a vision-language
        model's `images.ImageEncoder`, on the engine's `batch_sizes`), as its first prompt piece runs."""
        self._text = TextStream(tokenizer, self.stop) if tokenizer is not None else None
        seed = self.sampling.seed
        self._generator = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(2**62, ())))
        if self.images is not None:
            self._features = images.encode(self.images, batch_sizes)
            self._check_images(images, "input_ids")  # (the features per image known now, if not before)

    def row(self, taken: bool = True) -> list[float]:
        """Its row of the step's sampling tensor: its `sampling`'s, and its `adapter`."""
        row = self.sampling.row(taken)
        row[ADAPTER] = float(self.adapter)
        return row

    @property
    def prefilling(self) -> bool:
        """Whether part of the prompt is still to be written into the cache (no token taken yet)."""
        return self._prefilled < len(self.prompt)

    @property
    def held(self) -> bool:
        """Whether it waits for its first decode step: the other requests of its `generate()` call that
        have a slot are still prefilling. The rows of a call then decode together, in the graph of one
        batch bucket (a call of 2 prompts compiles no decode step for 1 row); no one sees the delay,
        as the call returns when its last row is done. Requests of the server are never held."""
        return len(self.tokens) == 1 and any(other._slot is not None and other.prefilling and not other.cancelled
                                             for other in self._call)

    @property
    def position(self) -> int:
        """The position of the last token taken (the next decode step feeds it)."""
        return len(self.prompt) + len(self.tokens) - 1

    def chosen(self, token: int, logits: torch.Tensor) -> int:
        """The next token: the device's `token`, or the choice on the host (`choose`) from `logits`;
        with `logprobs`, noted with its log-probability for the next `event`."""
        if self.choose is None and self.logprobs is None:
            return token
        logits = logits.to("cpu", torch.float32)
        token = token if self.choose is None else self.choose(logits, self._generator)
        if self.logprobs is not None:
            logprobs = logits.log_softmax(-1)
            top = logprobs.topk(self.logprobs) if self.logprobs else None
            self._logprobs.append(TokenLogprob(token, float(logprobs[token]), () if top is None else tuple(
                zip(top.indices.tolist(), top.values.tolist(), strict=True))))
        return token

    def take(self, token: int, eos_token_ids: set[int]) -> Event:
        """Takes its next token: the event of the step (finished by an end-of-sequence token, of
        `eos_token_ids` unless it has its own, a stop string, or `max_tokens`)."""
        self.tokens.append(token)
        text = self._text.add(token) if self._text is not None else ""
        finish = None
        if (self._text is not None and self._text.stopped) or token in (
                eos_token_ids if self.eos_token_ids is None else self.eos_token_ids):
            finish = "stop"
        elif len(self.tokens) >= self.max_tokens:
            finish = "length"
        if finish is not None and self._text is not None:
            text += self._text.finish()
        return self.event(text, finish)

    def targets(self, start: int, length: int, pad_token_id: int) -> list[list[int]] | None:
        """With `prompt_logprobs`, what a prefill piece of `length` positions from `start` scores: the
        prompt token after each position (`pad_token_id` past the prompt's last); else None."""
        if self.prompt_logprobs is None:
            return None
        following = self.prompt[start + 1:start + 1 + length]
        return [following + [pad_token_id] * (length - len(following))]

    def score(self, start: int, scores: tuple[torch.Tensor, ...]) -> None:
        """Notes the scores of a prefill piece from position `start` (`slots.slot_step`'s) for the
        first event: of each prompt token it predicts, once (a last piece moved back scores again
        positions the one before did)."""
        chosen, top_values, top_tokens = (score.tolist() for score in scores)
        if not self._prompt_logprobs:
            self._prompt_logprobs.append(TokenLogprob(self.prompt[0], None))
        for position in range(len(self._prompt_logprobs) - 1, min(start + len(chosen), len(self.prompt) - 1)):
            row = position - start
            top = zip(top_tokens[row][:self.prompt_logprobs], top_values[row][:self.prompt_logprobs], strict=True)
            self._prompt_logprobs.append(TokenLogprob(self.prompt[position + 1], chosen[row], tuple(top)))

    def event(self, text: str, finish_reason: str | None) -> Event:
        """The event of the step that took its last token (with the log-probabilities noted since the
        last; the first, with the prompt's)."""
        logprobs, self._logprobs = self._logprobs, []
        prompt = self._prompt_logprobs if self.prompt_logprobs is not None and len(self.tokens) == 1 else None
        return Event(text, len(self.tokens), finish_reason, logprobs=None if self.logprobs is None else logprobs,
                     prompt_logprobs=prompt)

    def next_uniform(self) -> float:
        """The next uniform number (its own generator: the same tokens whatever runs beside it)."""
        if self.sampling.temperature == 0:
            return 0.0
        return float(torch.rand((), generator=self._generator))
