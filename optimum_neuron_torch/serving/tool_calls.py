"""Tool calls: what a chat answer's text calls (`tools`, `tool_choice`), in the OpenAI API's shape.

The model is shown the tools by its chat template (`apply_chat_template(..., tools=...)`), and writes
its calls as that template taught it; a parser reads them back from the answer's text:

- `hermes` (Hermes, Qwen 2.5 and 3, SmolLM3...): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, after any text;
- `llama3_json` (Llama 3.1 to 3.3): the whole answer is `{"name": ..., "parameters": {...}}`, calls
  separated by `;`, maybe after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`.

With `tool_choice` `auto` (the default when tools are given) the answer is read by the parser the
server was started with (`--tool-call-parser`; by default the one the chat template's text names);
text that holds no well-formed call is the answer's content. With `required` or a named function
the answer is held to a grammar (`structured_output`), as vLLM does it, whatever the model's own
format: a JSON list of calls (`[{"name": ..., "parameters": {...}}, ...]`), or the named function's
arguments; so the calls always parse and name a tool given.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from openai.types.chat import ChatCompletionMessageToolCall
from openai.types.chat.chat_completion_message_tool_call import Function

from ..errors import InvalidRequestError

PARSERS = ("hermes", "llama3_json", "mistral")
# What a chat template's text holds when it teaches each parser's format.
TEMPLATE_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}


def parser_of_template(chat_template: str | dict[str, str] | None) -> str | None:
    """The parser of the tool calls a chat template teaches, from its text, or None."""
    text = json.dumps(chat_template) if isinstance(chat_template, dict) else chat_template or ""
    return next((parser for parser, marker in TEMPLATE_MARKERS.items() if marker in text), None)


@dataclass(frozen=True)
class ToolChoice:
    """How one request's answer calls its tools.

    Args:
        mode (`str`): `auto` (the parser reads the text), `required` (a list of calls, held to a
            grammar) or `named` (the arguments of `name`, held to a grammar).
        parser (`str`): the parser of `auto` (see `PARSERS`).
        name (`str`, *optional*): the function of `named`.
        parallel (`bool`): whether the answer may call several tools (`parallel_tool_calls`).
    """

    mode: str
    parser: str = "hermes"
    name: str | None = None
    parallel: bool = True

    def schema(self, tools: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The JSON schema the answer is held to (`required`, `named`), or None (`auto`)."""
        parameters = {tool["function"]["name"]: tool["function"].get("parameters") or {"type": "object"}
                      for tool in tools}
        if self.mode == "named":
            return parameters[self.name]
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for name, schema in parameters.items()]
            most = {} if self.parallel else {"maxItems": 1}
            return {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | most
        return None

    def read(self, text: str) -> tuple[str | None, list[ChatCompletionMessageToolCall]]:
        """The answer's content (None if it holds calls only) and its calls."""
        if self.mode == "named":
            return None, [_call(self.name, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)  # (the grammar made it a list of calls, unless cut short by max_tokens)
            except json.JSONDecodeError:
                return text, []
            return None, [_call(call["name"], call["parameters"]) for call in calls]
        found = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}[self.parser](text)
        if found is None:
            return text, []
        content, calls = found
        return content.strip() or None, calls if self.parallel else calls[:1]


def tool_choice(tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None,
                parser: str | None, parallel: bool = True) -> ToolChoice | None:
    """The `ToolChoice` of a request's `tools` and `tool_choice`, or None (no tools, or `none`).

    Raises:
        InvalidRequestError: a `tool_choice` without tools, naming a function not given, or `auto`
            with no parser (the chat template teaches none, and the server was given none).
    """
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return None
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) < len(names):
        raise InvalidRequestError(f"tools: two tools named alike in {names}", "tools")
    if choice == "none":
        return None
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise InvalidRequestError(f"tool_choice.function.name: {name!r} is not among the tools given {names}",
                                      "tool_choice.function.name")
        return ToolChoice("named", name=name)
    if choice == "required":
        return ToolChoice("required", parallel=parallel)
    if parser is None:
        raise InvalidRequestError("tools with tool_choice auto: this model's chat template writes no tool calls this "
                                  f"server reads; start it with --tool-call-parser (one of {', '.join(PARSERS)}), or "
                                  "ask for tool_choice required or a named function", "tool_choice")
    return ToolChoice("auto", parser, parallel=parallel)


def _call(name: str, arguments: str | dict[str, Any]) -> ChatCompletionMessageToolCall:
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ChatCompletionMessageToolCall(id=f"call_{uuid.uuid4().hex[:24]}", type="function",
                                         function=Function(name=name, arguments=arguments))


def _calls(objects: list[Any], arguments: str) -> list[ChatCompletionMessageToolCall] | None:
    """The calls `objects` hold (each a JSON object with a string `name` and an object under
    `arguments`), or None if any does not."""
    if not objects or any(not isinstance(item, dict) or not isinstance(item.get("name"), str)
                          or not isinstance(item.get(arguments, {}), dict) for item in objects):
        return None
    return [_call(item["name"], item.get(arguments, {})) for item in objects]


HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str) -> tuple[str, list[ChatCompletionMessageToolCall]] | None:
    if "<tool_call>" not in text:
        return None
    try:
        calls = _calls([json.loads(block) for block in HERMES.findall(text)], "arguments")
    except json.JSONDecodeError:
        return None
    return None if calls is None else (text[:text.index("<tool_call>")], calls)


def _llama3_json(text: str) -> tuple[str, list[ChatCompletionMessageToolCall]] | None:
    rest, objects, decoder = text.strip().removeprefix("<|python_tag|>").lstrip(), [], json.JSONDecoder()
    while rest.startswith("{"):
        try:
            item, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            return None
        objects.append(item)
        rest = rest[end:].lstrip().removeprefix(";").lstrip()
    if rest or not objects:  # (text after the calls, or none: an answer in words)
        return None
    for item in objects:  # (Llama's templates say `parameters`; some of its answers say `arguments`)
        if isinstance(item, dict) and "parameters" in item:
            item["arguments"] = item.pop("parameters")
    calls = _calls(objects, "arguments")
    return None if calls is None else ("", calls)


def _mistral(text: str) -> tuple[str, list[ChatCompletionMessageToolCall]] | None:
    content, marker, calls = text.partition("[TOOL_CALLS]")
    if not marker:
        return None
    try:
        objects = json.loads(calls)
    except json.JSONDecodeError:
        return None
    found = _calls(objects if isinstance(objects, list) else [objects], "arguments")
    return None if found is None else (content, found)
