"""The server's answers in the OpenAI API's shapes (the `openai` package's types): whole, or as
the chunks of a stream of server-sent events; each choice's log-probabilities, usage and finish reason."""

from __future__ import annotations

import base64
import itertools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch
from openai.types import Completion, CompletionChoice, CompletionUsage, CreateEmbeddingResponse, Embedding
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionMessageToolCall,
    ChatCompletionTokenLogprob,
)
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs

from ..generation.requests import Event, TokenLogprob
from .protocol import error_body
from .tool_calls import ToolChoice


@dataclass
class Answer:
    """The answer to one request of `choices` choices, whole (`whole`) or streamed (`chat_chunks`,
    `completion_chunks`), from its choices' (choice, event) pairs.

    Args:
        identity (`str`): its id (`chatcmpl-...`, `cmpl-...`).
        created (`int`): when it was created (seconds since the epoch).
        model (`str`): the model, as the request named it.
        choices (`int`): its choices.
        prompt_tokens (`int`): the tokens of its prompts (each counted once, whatever `n`).
        decode (`Callable[[int], str]`): a token's text (decoded alone).
        include_usage (`bool`): whether a stream ends with a chunk of the usage.
        continuous_usage (`bool`): whether each chunk of a choice carries the usage so far (vLLM's
            `stream_options.continuous_usage_stats`, which guidellm asks).
        logprobs (`bool`): whether each choice has its tokens' log-probabilities.
        echoes (`list[str]`, *optional*): per choice, the prompt's text its completion starts with.
        tools (`ToolChoice`, *optional*): how a chat answer's text calls tools; such an answer's text is
            read once it ends (streamed: in one delta, before its finish reason).
    """

    identity: str
    created: int
    model: str
    choices: int
    prompt_tokens: int
    decode: Callable[[int], str]
    include_usage: bool = False
    logprobs: bool = False
    echoes: list[str] | None = None
    tools: ToolChoice | None = None
    continuous_usage: bool = False

    def so_far(self, latest: list[Event | None]) -> CompletionUsage | None:
        """With `continuous_usage`, the usage of the choices' latest events, else None."""
        return usage(self.prompt_tokens, [event for event in latest if event]) if self.continuous_usage else None

    def message(self, text: str, reason: str) -> tuple[str | None, list[ChatCompletionMessageToolCall], str]:
        """A chat answer's content, tool calls and finish reason (`tool_calls` if it calls any, unless
        the request named the function, as the OpenAI API answers), from its `text`."""
        if self.tools is None:
            return text, [], reason
        content, calls = self.tools.read(text)
        return content, calls, "tool_calls" if calls and self.tools.mode != "named" and reason == "stop" else reason

    async def whole(self, events: AsyncIterator[tuple[int, Event]], chat: bool) -> ChatCompletion | Completion | None:
        """The whole answer once every choice had its last event, or None if the client went away."""
        texts = [[] if self.echoes is None else [self.echoes[index]] for index in range(self.choices)]
        last, tokens = [None] * self.choices, [[] for _ in range(self.choices)]
        async for index, event in events:
            texts[index].append(event.text)
            tokens[index] += (event.prompt_logprobs or []) + (event.logprobs or [])
            last[index] = event
        if any(event is None or event.finish_reason is None for event in last):
            return None
        done = [("".join(text), finish(event), taken if self.logprobs else None)
                for text, event, taken in zip(texts, last, tokens, strict=True)]
        if chat:  # (`logprobs` and `tool_calls` left unset unless there are some)
            choices = []
            for index, (text, reason, taken) in enumerate(done):
                content, calls, reason = self.message(text, reason)
                choices.append(ChatChoice(
                    index=index, message=ChatCompletionMessage(role="assistant", content=content,
                                                               **given(tool_calls=calls or None)),
                    finish_reason=reason, **given(logprobs=chat_logprobs(ChoiceLogprobs, taken, self.decode))))
            return ChatCompletion(id=self.identity, created=self.created, model=self.model, object="chat.completion",
                                  choices=choices, usage=usage(self.prompt_tokens, last))
        choices = [CompletionChoice(index=index, text=text, finish_reason=reason,
                                    **given(logprobs=completion_logprobs(taken, 0, self.decode)))
                   for index, (text, reason, taken) in enumerate(done)]
        return Completion(id=self.identity, created=self.created, model=self.model, object="text_completion",
                          choices=choices, usage=usage(self.prompt_tokens, last))

    async def chat_chunks(self, events: AsyncIterator[tuple[int, Event]]) -> AsyncIterator[ChatCompletionChunk]:
        """A chat answer's chunks: each choice's role, then its text as it comes, its finish reason."""
        def chunk(index: int | None, delta: ChoiceDelta | None = None, reason: str | None = None,
                  total: CompletionUsage | None = None, logprobs: list[TokenLogprob] | None = None
                  ) -> ChatCompletionChunk:
            found = chat_logprobs(ChunkLogprobs, logprobs, self.decode) if logprobs else None
            choices = [] if index is None else [ChunkChoice(index=index, delta=delta, finish_reason=reason,
                                                            **given(logprobs=found))]
            total = total if index is None else self.so_far(latest)
            return ChatCompletionChunk(id=self.identity, created=self.created, model=self.model,
                                       object="chat.completion.chunk", choices=choices, **given(usage=total))

        latest = [None] * self.choices
        for index in range(self.choices):
            yield chunk(index, ChoiceDelta(role="assistant", content=""))
        last, held = [None] * self.choices, [("", []) for _ in range(self.choices)]  # (what `tools` reads at the end)
        async for index, event in events:
            latest[index] = event
            if self.tools is not None:
                held[index] = (held[index][0] + event.text, held[index][1] + (event.logprobs or []))
            elif event.text or event.logprobs:
                yield chunk(index, ChoiceDelta(content=event.text), logprobs=event.logprobs)
            if event.finish_reason is not None:
                reason = finish(event)
                if self.tools is not None:
                    content, calls, reason = self.message(held[index][0], reason)
                    yield chunk(index, ChoiceDelta(content=content, tool_calls=[ChoiceDeltaToolCall(
                        index=position, id=call.id, type="function", function=ChoiceDeltaToolCallFunction(
                            name=call.function.name, arguments=call.function.arguments))
                        for position, call in enumerate(calls)] or None), logprobs=held[index][1] or None)
                yield chunk(index, ChoiceDelta(), reason)
                last[index] = event
        if self.include_usage and all(last):
            yield chunk(None, total=usage(self.prompt_tokens, last))

    async def completion_chunks(self, events: AsyncIterator[tuple[int, Event]]) -> AsyncIterator[Completion]:
        """A completion's chunks: each choice's text as it comes (after its prompt's, with `echoes`)."""
        def chunk(index: int | None, text: str = "", reason: str | None = None, total: CompletionUsage | None = None,
                  logprobs: Logprobs | None = None) -> Completion:
            # (`model_construct`: the `openai` type wants a finish reason, which a chunk before the last has not)
            choices = [] if index is None else [CompletionChoice.model_construct(
                index=index, text=text, logprobs=logprobs, finish_reason=reason)]
            total = total if index is None else self.so_far(latest)
            return Completion(id=self.identity, created=self.created, model=self.model, object="text_completion",
                              choices=choices, **given(usage=total))

        latest, last = [None] * self.choices, [None] * self.choices
        offsets, started = [0] * self.choices, [False] * self.choices
        async for index, event in events:
            latest[index] = event
            text, taken = event.text, event.logprobs
            if not started[index]:  # (its first chunk starts with its prompt, with `echo`)
                started[index] = True
                text = text if self.echoes is None else self.echoes[index] + text
                taken = taken if event.prompt_logprobs is None else event.prompt_logprobs + (taken or [])
            if text or event.finish_reason is not None or taken:
                logprobs = completion_logprobs(taken, offsets[index], self.decode)
                yield chunk(index, text, event.finish_reason and finish(event), logprobs=logprobs)
                offsets[index] += sum(map(len, logprobs.tokens)) if logprobs else 0
            if event.finish_reason is not None:
                last[index] = event
        if self.include_usage and all(last):
            yield chunk(None, total=usage(self.prompt_tokens, last))


def given(**fields: Any) -> dict[str, Any]:
    """The fields whose value is not None (the others stay unset in the answer, as before they existed)."""
    return {name: value for name, value in fields.items() if value is not None}


def token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs(kind: type[ChoiceLogprobs | ChunkLogprobs], taken: list[TokenLogprob] | None,
                   decode: Callable[[int], str]) -> ChoiceLogprobs | ChunkLogprobs | None:
    """A chat choice's `logprobs`: each token's text, bytes and log-probability, with the most likely ones."""
    if taken is None:
        return None

    def entry(token: int) -> dict[str, Any]:
        text = decode(token)
        return {"token": text, "bytes": list(text.encode())}

    return kind(content=[ChatCompletionTokenLogprob(**entry(item.token), logprob=item.logprob, top_logprobs=[
        TopLogprob(**entry(token), logprob=logprob) for token, logprob in item.top]) for item in taken])


def completion_logprobs(taken: list[TokenLogprob] | None, offset: int, decode: Callable[[int], str]
                         ) -> Logprobs | None:
    """A completion choice's `logprobs` (the legacy API's columns); `offset`: the text's length before.
    An echoed prompt's first token has none (null, as in the OpenAI API)."""
    if taken is None:
        return None
    tokens = [decode(item.token) for item in taken]
    offsets = list(itertools.accumulate(map(len, tokens), initial=offset))[:len(tokens)]
    # (`model_construct`: the `openai` type's lists do not take the nulls the API gives)
    return Logprobs.model_construct(
        tokens=tokens, token_logprobs=[item.logprob for item in taken], text_offset=offsets,
        top_logprobs=[None if item.logprob is None else {decode(token): logprob for token, logprob in item.top}
                      for item in taken])


def embeddings(vectors: torch.Tensor, encoding_format: str, model: str, tokens: int) -> CreateEmbeddingResponse:
    """The answer of `/v1/embeddings`: each input's vector as floats, or (`base64`) its float32 bytes
    (little-endian) in base64, as the OpenAI API gives them."""
    data = [Embedding.model_construct(  # (`model_construct`: the `openai` type's field is a list of floats)
        object="embedding", index=index,
        embedding=vector.tolist() if encoding_format == "float" else base64.b64encode(
            vector.numpy().astype("<f4").tobytes()).decode()) for index, vector in enumerate(vectors)]
    return CreateEmbeddingResponse(object="list", data=data, model=model,
                                   usage={"prompt_tokens": tokens, "total_tokens": tokens})


class RequestFailed(RuntimeError):
    """The engine failed one of the request's choices (its last event says why)."""


def finish(event: Event) -> str:
    if event.finish_reason == "error":
        raise RequestFailed(f"the serving engine failed during this request: {event.error or 'the engine stopped'}")
    return event.finish_reason


def usage(prompt_tokens: int, last: list[Event]) -> CompletionUsage:
    """The usage of a request: its prompts' tokens (once each, whatever `n`), every choice's tokens."""
    completion_tokens = sum(event.completion_tokens for event in last)
    return CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens)


async def sse(chunks: AsyncIterator[ChatCompletionChunk | Completion]) -> AsyncIterator[str]:
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]`; a request the engine failed
    part-way ends with an error event (the OpenAI error body), as vLLM's streams do."""
    try:
        async for chunk in chunks:
            yield f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
    except RequestFailed as error:
        yield f"data: {json.dumps(error_body(f'internal error: {error}', 'server_error'))}\n\n"
    yield "data: [DONE]\n\n"
