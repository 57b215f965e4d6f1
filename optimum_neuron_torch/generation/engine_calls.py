"""`generate()` on the generation engine: a call's rows become requests, its output Transformers'.

What a call keeps of Transformers' `generate()`:

- each row of `input_ids`, its left padding taken off (as its attention mask says), repeated
  `num_return_sequences` times, is one request: a prompt alone, whose tokens do not depend on the
  other rows, nor on other threads' calls running at the same time;
- the logits processors Transformers builds for the call are applied by the engine's step, on the
  device, when they are the temperature, top-k, top-p and min-p warpers and the repetition penalty;
  a call with any other processor (`min_new_tokens`, `no_repeat_ngram_size`, `bad_words_ids`, the
  caller's own...) has its tokens chosen on the host instead: each step reads the row's logits
  (float32, as Transformers' loop reads them), runs the row's processors on them (CPU tensors, as
  compiled generation gives them; built per row as Transformers builds them for the batch), given the
  row as Transformers' loop gives it (its left padding included), and takes the argmax or draws from
  the softmax with the row's own generator (`EngineCall.choose`), which the call counts
  (`host_tokens`); a call with processors that read other rows of the batch (classifier-free
  guidance, a `prefix_allowed_tokens_fn`) is refused (it runs Transformers' eager generate(), see
  `neuron_generation`);
- the new-token budget and the end-of-sequence tokens stop a row in the engine; the other stopping
  criteria (stop strings, `max_time`, the caller's) run on the host after each token of the row,
  given the row's sequence so far (`[1, length]`) and no scores;
- a streamer gets the prompt, then each token as it comes (one row, as Transformers' streamers take);
- the output is the input ids as given, then each row's new tokens, padded with the pad token to
  the longest, as Transformers returns them; with `return_dict_in_generate`, in Transformers' output
  class, with the scores and logits of each step when asked (`output_scores`, `output_logits`): those
  read each row's logits on the host, which then chooses its tokens, and keep the rows in step as
  Transformers' loop does (a row that ended is fed the pad token, its scores still recorded, until
  every row ended). It holds no cache (the engine's slots are not a Transformers cache).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import (
    ClassifierFreeGuidanceLogitsProcessor,
    EosTokenCriteria,
    GenerateDecoderOnlyOutput,
    GenerationMode,
    LogitsProcessorList,
    MaxLengthCriteria,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    SynthIDTextWatermarkLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from .buckets import Buckets
from .engine import GenerationEngine
from .padding import default_attention_mask
from .requests import Event, Request, SamplingSettings
from .sampling import SamplingParameters
from .static_plans import image_placeholder

# The arguments of generate() besides the generation config's fields that a call on the engine takes.
ENGINE_KWARGS = {"attention_mask", "streamer", "tokenizer", "stopping_criteria", "logits_processor", "use_cache"}
# Logits processors that read a row with the others of its batch (or its index in it), keep one state for
# the batch, or run the model themselves: not per row.
BATCH_PROCESSORS = (ClassifierFreeGuidanceLogitsProcessor, UnbatchedClassifierFreeGuidanceLogitsProcessor,
                    PrefixConstrainedLogitsProcessor, SynthIDTextWatermarkLogitsProcessor)


@dataclass
class EngineCall:
    """One generate() call, as requests of the engine.

    Args:
        input_ids (`torch.Tensor`): the rows as given (on the host), repeated `num_return_sequences` times.
        prompts (`list[list[int]]`): each row without its padding.
        max_new_tokens (`int`): the most tokens each row generates.
        sampling (`list[SamplingSettings]`): how each row chooses its tokens (its seed drawn from
            torch's default generator, so `torch.manual_seed` makes the call reproducible).
        eos_token_ids (`set[int]`): the tokens that end a row.
        pad_token_id (`int`): what fills a row that ended before the longest.
        criteria (`StoppingCriteriaList`): the stopping criteria that run on the host.
        streamer (`Any`): Transformers' streamer, or None.
        host_processors (`list[LogitsProcessorList]`, *optional*): each row's logits processors, when
            the device cannot apply them: each token is then chosen on the host (see `choose`).
        do_sample (`bool`): whether the host draws the tokens it chooses (else takes the argmax).
        returned (`tuple[bool, bool]`, *optional*): with `return_dict_in_generate`, whether the output
            holds each step's (scores, logits); those need `host_processors`.
        images (`list[torch.Tensor | None]`, *optional*): a vision-language model's call: each row's
            pixel values (None: a row without an image).
    """

    input_ids: torch.Tensor
    prompts: list[list[int]]
    max_new_tokens: int
    sampling: list[SamplingSettings]
    eos_token_ids: set[int]
    pad_token_id: int
    criteria: StoppingCriteriaList
    streamer: Any = None
    host_processors: list[LogitsProcessorList] | None = None
    do_sample: bool = False
    returned: tuple[bool, bool] | None = None
    images: list[torch.Tensor | None] | None = None
    host_tokens: int = 0  # tokens chosen on the host so far
    failures: list[BaseException] = field(default_factory=list, repr=False)  # the caller's code's (see `_failed`)
    _requests: list[Request] = field(default_factory=list, repr=False)
    _traceback: Any = field(default=None, repr=False)  # the first failure's (the engine strips what it keeps)
    # Rows kept in step (see `_in_step`): per row, its (scores, logits) of each step so far, and its
    # length when it ended; the call's length once every row ended.
    _steps: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list, repr=False)
    _ends: list[int | None] = field(default_factory=list, repr=False)
    _length: int | None = None

    @property
    def _in_step(self) -> bool:
        """Whether the rows go on until every row ended, as in Transformers' loop, whose scores and
        logits of each step the output holds for every row."""
        return self.returned is not None and any(self.returned)

    def run(self, engine: GenerationEngine, device: torch.device) -> torch.Tensor | GenerateDecoderOnlyOutput:
        """Runs the call's requests on `engine` until each ends; what Transformers' generate() returns
        (the sequences, or its output class with `return_dict_in_generate`), on `device`.

        Raises:
            Exception: what failed a request (in the engine, a stopping criterion or the streamer).
        """
        if self.streamer is not None:
            self.streamer.put(self.input_ids)
        # (rows in step end on the host, see `_keep_in_step`: the engine stops them at their budget only)
        eos = set() if self._in_step else self.eos_token_ids
        self._steps = [([], []) for _ in self.prompts]
        self._ends = [None] * len(self.prompts)
        images = self.images or [None] * len(self.prompts)
        self._requests = requests = [Request(prompt, self.max_new_tokens, sampling, [], lambda event: None,
                                             eos_token_ids=eos, images=pixels)
                                     for prompt, sampling, pixels in zip(self.prompts, self.sampling, images,
                                                                         strict=True)]
        for row, request in enumerate(requests):  # (events come from the one thread running the engine)
            request.on_event = lambda event, row=row, request=request: self._on_event(row, request, event)
            if self.host_processors is not None:
                request.choose = lambda logits, generator, row=row, request=request: self.choose(
                    row, request, logits, generator)
        engine.complete(requests)
        failure = next((request.error for request in requests if request.error is not None), None)
        if self.failures:
            raise self.failures[0].with_traceback(self._traceback)
        if failure is not None:
            raise failure
        if self.streamer is not None:
            self.streamer.end()
        width = self._length or max(len(request.tokens) for request in requests)
        new = torch.full((len(requests), width), self.pad_token_id, dtype=self.input_ids.dtype)
        for row, request in enumerate(requests):
            tokens = request.tokens[:width]
            new[row, : len(tokens)] = torch.tensor(tokens, dtype=self.input_ids.dtype)
        sequences = torch.cat([self.input_ids, new], dim=1).to(device)
        if self.returned is None:
            return sequences
        kept = [tuple(torch.stack([self._steps[row][kind][step] for row in range(len(requests))]).to(device)
                      for step in range(width)) if wanted else None
                for kind, wanted in enumerate(self.returned)]
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=kept[0], logits=kept[1])

    def choose(self, row: int, request: Request, logits: torch.Tensor, generator: torch.Generator) -> int:
        """The next token of `row` (its `request`), chosen on the host as Transformers' loop chooses it:
        the call's processors run on the row's float32 `logits` (`[vocab]`), given the row so far as
        the loop gives it (the input ids as passed, left padding included, then the new tokens); then
        the argmax, or a draw from the softmax with the row's `generator`."""
        try:
            # (the raw logits the output returns are kept from processors that change their scores in place)
            scores = self.host_processors[row](self._so_far(row, request),
                                               logits[None].clone() if self._in_step else logits[None])
            if self._in_step:
                self._steps[row][0].append(scores[0])
                self._steps[row][1].append(logits)
            if self._in_step and self._ends[row] is not None:  # (ended: fed the pad token, as Transformers does)
                token = torch.tensor(self.pad_token_id)
            elif self.do_sample:
                token = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)
            else:
                token = scores.argmax(-1)
        except BaseException as error:  # (the caller's processors: the call raises it)
            self._failed(error)
            raise
        self.host_tokens += 1
        return int(token)

    def _so_far(self, row: int, request: Request) -> torch.Tensor:
        """`row` as Transformers' loop gives it to processors and criteria: `[1, length]`, the input ids as
        passed (left padding included), then the row's new tokens."""
        return torch.cat([self.input_ids[row], torch.tensor(request.tokens, dtype=self.input_ids.dtype)])[None]

    def _failed(self, error: BaseException) -> None:
        """The caller's code (a processor, a criterion, the streamer) raised `error`: the call raises it,
        and its other rows end now rather than run to their last token."""
        if not self.failures:
            self._traceback = error.__traceback__
        self.failures.append(error)
        for request in self._requests:
            request.cancelled = True

    def _on_event(self, row: int, request: Request, event: Event) -> None:
        """After each token of `row`: the streamer gets it, and the host's criteria may end the row."""
        if event.finish_reason == "error":  # (the engine failed the row: the call raises it, its other rows end)
            for other in self._requests:
                other.cancelled = True
            return
        try:
            if self.streamer is not None:
                self.streamer.put(torch.tensor([request.tokens[-1]]))
            if self._in_step:
                self._keep_in_step(row, request, event)
            elif event.finish_reason is None and len(self.criteria):
                if bool(self.criteria(self._so_far(row, request), None).any()):
                    request.cancelled = True  # (done: it leaves its slot)
        except BaseException as error:
            self._failed(error)
            raise

    def _keep_in_step(self, row: int, request: Request, event: Event) -> None:
        """After each token of `row` when the rows go on in step: whether the row ended now (an
        end-of-sequence token, its budget, a stopping criterion), and once every row ended, the
        call's length, at which each row leaves the engine (a row ahead is cut back to it)."""
        if self._ends[row] is None:
            if (request.tokens[-1] in self.eos_token_ids or event.finish_reason is not None
                    or (len(self.criteria) and bool(self.criteria(self._so_far(row, request), None).any()))):
                self._ends[row] = len(request.tokens)
                if all(end is not None for end in self._ends):
                    self._length = max(self._ends)
                    for other in self._requests:
                        other.cancelled = other.cancelled or len(other.tokens) >= self._length
        if self._length is not None and len(request.tokens) >= self._length:
            request.cancelled = True


def plan(model: PreTrainedModel, buckets: Buckets, input_ids: torch.Tensor | None,
         generation_config: GenerationConfig | None, kwargs: dict[str, Any]) -> EngineCall | str:
    """The call `model.generate(input_ids, generation_config, **kwargs)` as requests of an engine of
    `buckets`, or why it cannot run there.

    Raises:
        IndexError: a token id of `input_ids` outside the vocabulary.
        ValueError: as Transformers raises it for the same call (stop strings without a tokenizer).
    """
    if input_ids is None or not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        return "generation without a 2D tensor of input ids"
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    if config.disable_compile:
        return "disable_compile=True"
    takes = ENGINE_KWARGS | ({"pixel_values"} if image_placeholder(model) is not None else set())
    others = sorted(name for name, value in model_kwargs.items() if name not in takes and value is not None)
    if others:
        return f"the arguments {', '.join(others)}"
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"{mode.value.replace('_', ' ')}"
    if config.output_attentions or config.output_hidden_states:
        return "output_attentions / output_hidden_states"
    returned = (bool(config.output_scores), bool(config.output_logits)) if config.return_dict_in_generate else None
    if config.cache_implementation not in (None, "static") or model_kwargs.get("use_cache") is False:
        return f"cache_implementation={config.cache_implementation!r} / use_cache=False"
    repeats = config.num_return_sequences or 1
    if repeats > 1 and not config.do_sample:
        return "num_return_sequences > 1 without sampling"
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = default_attention_mask(input_ids, config)
    mask = mask.cpu()
    if mask.shape != input_ids.shape or bool((mask[:, 1:] < mask[:, :-1]).any()) or bool((mask[:, -1] == 0).any()):
        return "an attention mask other than left padding"
    images = _images_of_rows(model, input_ids.cpu(), model_kwargs.get("pixel_values"))
    if isinstance(images, str):
        return images
    images = images and [image for image in images for _ in range(repeats)]
    input_ids = input_ids.cpu().repeat_interleave(repeats, dim=0)
    mask = mask.repeat_interleave(repeats, dim=0)
    vocab = model.get_input_embeddings().num_embeddings
    outside = input_ids[mask.bool() & ((input_ids < 0) | (input_ids >= vocab))]
    if outside.numel():
        raise IndexError(f"input_ids holds the token id {int(outside[0])}, outside the model's vocabulary of {vocab} "
                         "(its input embedding's rows): check the tokenizer matches the model")
    prompts = [row[row_mask.bool()].tolist() for row, row_mask in zip(input_ids, mask, strict=True)]
    width = input_ids.shape[1]
    new_tokens = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - width
    longest = max(map(len, prompts))
    if new_tokens < 1 or longest + new_tokens > buckets.max_length:
        return (f"{longest + new_tokens} positions (a prompt of {longest} tokens, {new_tokens} new tokens) where "
                f"the engine's cache holds {buckets.max_length}")
    model._prepare_special_tokens(config, "attention_mask" in model_kwargs, device=torch.device("cpu"))
    # (each row's own processors, as Transformers builds them for the batch: the row's ids and mask)
    processors = [model._get_logits_processor(
        generation_config=config, input_ids_seq_length=width, encoder_input_ids=input_ids[row:row + 1],
        logits_processor=model_kwargs.get("logits_processor"), device=torch.device("cpu"),
        model_kwargs={"attention_mask": mask[row:row + 1]}) for row in range(input_ids.shape[0])]
    settings = _placement(processors[0], config, padded=bool((mask == 0).any()))
    if isinstance(settings, str):
        return settings
    on_host = settings is None or (returned is not None and any(returned))  # (scores are the host's)
    if on_host:
        settings = {}  # (the device's step takes the greedy token, which the host ignores)
    criteria = model._get_stopping_criteria(config, model_kwargs.get("stopping_criteria") or StoppingCriteriaList(),
                                            tokenizer=model_kwargs.get("tokenizer"))
    host_criteria = StoppingCriteriaList(criterion for criterion in criteria
                                         if not isinstance(criterion, MaxLengthCriteria | EosTokenCriteria))
    eos = config._eos_token_tensor
    eos_ids = set() if eos is None else set(eos.reshape(-1).tolist())
    pad = config._pad_token_tensor
    pad_id = int(pad) if pad is not None else min(eos_ids, default=0)
    rows = []
    for _ in prompts:  # (each row its own seed, from torch's default generator)
        seed = int(torch.randint(2**62, ())) if config.do_sample else None
        rows.append(SamplingSettings(**{**settings, "seed": seed}))
    return EngineCall(input_ids, prompts, new_tokens, rows, eos_ids, pad_id, host_criteria,
                      model_kwargs.get("streamer"), processors if on_host else None, bool(config.do_sample), returned,
                      images)


def _images_of_rows(model: PreTrainedModel, input_ids: torch.Tensor, pixel_values: torch.Tensor | None
                    ) -> list[torch.Tensor | None] | str | None:
    """Each row's images (its pixel values, None for a row without one) of a vision-language model's
    call, given in the order of their placeholders, as its processor gives them; or why the rows'
    placeholders do not split the images (images of different feature counts)."""
    if pixel_values is None:
        return None
    placeholders = (input_ids == image_placeholder(model)).sum(dim=1).tolist()
    per_image, left = divmod(sum(placeholders), pixel_values.shape[0])
    if left or per_image == 0 or any(count % per_image for count in placeholders):
        return (f"{pixel_values.shape[0]} images for {sum(placeholders)} image placeholders, which do not split "
                "into images of one size")
    images, start = [], 0
    for count in placeholders:
        images.append(pixel_values[start:start + count // per_image].cpu() if count else None)
        start += count // per_image
    return images


def host_processors(model: PreTrainedModel, generation_config: GenerationConfig | None = None) -> list[str]:
    """The logits processors of a `generate()` call with `generation_config` (default: the model's)
    that the engine's step does not apply on the device, which make its tokens chosen on the host
    (every processor of the call then runs there): their class names, empty if none."""
    config = copy.deepcopy(generation_config or model.generation_config)
    model._prepare_special_tokens(config, False, device=torch.device("cpu"))
    processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=1,
                                             encoder_input_ids=torch.zeros((1, 1), dtype=torch.long),
                                             device=torch.device("cpu"), model_kwargs={})
    if _placement(processors, config) is not None:
        return []  # (on the device, or off the engine)
    return [type(processor).__name__ for processor in processors]


def _placement(processors: LogitsProcessorList, config: GenerationConfig, padded: bool = False
               ) -> dict[str, Any] | str | None:
    """Where a row's `processors` run: on the device (the `SamplingSettings` fields of the engine's
    step), on the host (None), or off the engine (why: processors that read the whole batch).
    The step's repetition penalty reads the prompt without its padding: Transformers' does when it
    knows the mask (`prompt_ignore_length`), a caller's own does not, unless no row is `padded`."""
    coupled = sorted({type(p).__name__ for p in processors if isinstance(p, BATCH_PROCESSORS)})
    if coupled:
        return f"logits processors reading the whole batch ({', '.join(coupled)})"
    penalties = [processor for processor in processors if isinstance(processor, RepetitionPenaltyLogitsProcessor)]
    warpers = LogitsProcessorList(processor for processor in processors if processor not in penalties)
    settings: dict[str, Any] = {}
    if penalties:
        if (len(penalties) > 1 or processors[0] is not penalties[0]
                or (padded and penalties[0].prompt_ignore_length is None)):
            return None
        settings["repetition_penalty"] = float(penalties[0].penalty)
    if not config.do_sample:
        return settings if not warpers else None
    parameters = SamplingParameters.of(warpers)
    if parameters is None or parameters.min_tokens_to_keep != 1:
        return None
    return {**settings, "temperature": parameters.temperature, "top_k": parameters.top_k,
            "top_p": parameters.top_p, "min_p": parameters.min_p}
