"""The OpenAI API's request bodies, as this server reads them, and its error bodies.

Responses are the `openai` package's own types (`ChatCompletion`, `ChatCompletionChunk`,
`Completion`, ...): what the official client parses. Requests are validated here, strictly (a
string where a number goes is refused, not converted), and every refusal names its field, as the
OpenAI API's error body does (`{"error": {"message", "type", "param", "code"}}`). Fields of the API
this server does not implement (for the kind of request: `echo` is a completion's) are refused when
given a value other than their default, never silently ignored; fields the API does not define are
ignored with a logged warning, as vLLM does (clients send other servers' extensions), but for the
extensions taken here (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import InvalidRequestError
from ..generation.requests import MAX_LOGPROBS

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 4  # as the OpenAI API

# Fields of the API the server does not implement, with the value that means "not used".
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "functions": (None, []),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str  # (a data URL: `data:image/png;base64,...`)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class CalledFunction(_Strict):
    name: str
    arguments: str  # (JSON, as the API gives it)


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None  # (None: an assistant's message of tool calls)
    tool_calls: list[ToolCall] | None = None  # (an assistant's)
    tool_call_id: str | None = None  # (a tool's answer: to which call)
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def images(self) -> list[tuple[int, str]]:
        """The URL of each image part, with its index among the parts."""
        parts = self.content if isinstance(self.content, list) else []
        return [(index, part.image_url.url) for index, part in enumerate(parts) if isinstance(part, ImagePart)]

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: its tool calls' arguments as objects (as
        Transformers' templates and vLLM give them), the fields it has."""
        message = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _json_or_text(call.function.arguments)}}
                for call in self.tool_calls]
        return message | {name: getattr(self, name) for name in ("tool_call_id", "name") if getattr(self, name)}


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # (a JSON schema of its arguments)
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchema(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # (`schema` is pydantic's own)
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # (vLLM's: the usage so far in every chunk)


class _GenerationRequest(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    # (beyond the OpenAI API, as vLLM takes them: -1 or 0 is every token for top_k; ignore_eos: up to max_tokens)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # (a 64-bit integer, as vLLM takes)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=2**31 - 1)  # (choices per prompt: at most the slots, see `app`)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None  # (answers held to JSON: see `structured_output`)
    logit_bias: dict[str, float] | None = None  # (token id: bias in [-100, 100], added to its logit)
    user: str | None = None

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
        return stop

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def logit_bias_given(self, vocab: int) -> dict[int, float] | None:
        """`logit_bias` with token ids as integers, or None.

        Raises:
            InvalidRequestError: a key that is no token id of the `vocab`, or a bias outside [-100, 100].
        """
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= vocab:
                raise InvalidRequestError(f"logit_bias: {key!r} is not a token id of the model's vocabulary "
                                          f"[0, {vocab})", f"logit_bias.{key}")
            if not -100 <= value <= 100:
                raise InvalidRequestError(f"logit_bias: {value} for {key} is outside [-100, 100]", f"logit_bias.{key}")
            bias[int(key)] = float(value)
        return bias or None

    def response_format_given(self) -> dict[str, Any] | None:
        """`response_format` as the client gave it (the OpenAI API's names), or None."""
        return self.response_format and self.response_format.model_dump(by_alias=True, exclude_none=True)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None  # (see `tool_calls`)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tools_given(self) -> list[dict[str, Any]] | None:
        """The tools, as the client gave them (the OpenAI API's names), or None."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def tool_choice_given(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_asked(self) -> int | None:
        """How many of the most likely tokens each token's log-probabilities come with, or None (none asked)."""
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0

    def prompt_logprobs_asked(self) -> None:
        return None  # (a chat answer does not echo its prompt)


class CompletionRequest(_GenerationRequest):
    # One prompt (text or token ids) or a batch of them (texts, or lists of token ids: lm-eval sends those).
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # (the answer starts with the prompt; with `logprobs`, scored: lm-eval's loglikelihood)

    def max_new_tokens(self) -> int | None:
        # (the OpenAI API's default for completions is 16 tokens)
        return 16 if self.max_tokens is None else self.max_tokens

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        """How many of the most likely tokens each prompt token's log-probability comes with, or None
        (the prompt is not scored: no `echo`, or no `logprobs`)."""
        return self.logprobs if self.echo else None


def parse(body: bytes, request_type: type[_GenerationRequest]) -> _GenerationRequest:
    """The request in `body` (JSON).

    Raises:
        InvalidRequestError: the body is not JSON, or a field is missing, of the wrong type, out of
            range, or not implemented here (names the field).
    """
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InvalidRequestError(f"the request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    for name, unused in UNSUPPORTED_FIELDS.items():
        if name in data and name not in request_type.model_fields and not any(
                data[name] == value and type(data[name]) is type(value) for value in unused):
            raise InvalidRequestError(f"{name} is not supported by this server; leave it out", name)
    try:
        request = request_type.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"] if not _type_tag(part)) or None
        raise InvalidRequestError(f"{field}: {first['msg']}" if field else first["msg"], field) from None
    if request.model_extra:
        logger.warning("ignored the fields the OpenAI API does not define: %s", ", ".join(sorted(request.model_extra)))
    return request


def _type_tag(part: int | str) -> bool:
    """Whether a part of a pydantic error's location names a member of a union (`str`,
    `list[int]`, `function-after[...]`) rather than a field or an index."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An error as the OpenAI API gives it (`code` where the API gives one: `model_not_found`)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class LoadLoraAdapterRequest(_Strict):
    """The body of `POST /v1/load_lora_adapter` (vLLM's)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Strict):
    """The body of `POST /v1/unload_lora_adapter` (vLLM's)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class EmbeddingRequest(_Strict):
    model: str
    # One input (a text or token ids) or a batch of them, as the OpenAI API takes them.
    input: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"  # (the `openai` client asks base64)
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
