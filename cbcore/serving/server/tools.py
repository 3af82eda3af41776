"""Tool calling on `/v1/chat/completions`: OpenAI's `tools` and `tool_choice`, the tools rendered by the model's chat
template, and the calls taken out of the generated text into the message's `tool_calls`.

What each `tool_choice` does, as vLLM does it:

- `none`: the text is free and is the message's content; no tool calls.
- `auto`: the text is free; tool calls are parsed out of it by the model's response template (transformers': the
  tokenizer's own `response_template`, else transformers' template for its model type, e.g. Qwen's `<tool_call>`
  JSON); a model with none is a 400.
- `required`: the text is a JSON array of `{"name", "parameters"}`, one schema per tool, enforced by a grammar; every
  element is a call.
- a named function: the text is that function's parameters, enforced by its JSON schema; one call of it.

So `required` and a named function never depend on the model's own format, and always give calls whose arguments
validate against the tool's schema (compact JSON: a small model left free to add whitespace may add it until
max_tokens); `parallel_tool_calls: false` limits `required` to one call. Calls are sent, in
streaming, as one delta each (its id, name and whole arguments) once complete.
"""

from __future__ import annotations

import inspect
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...structured_output import StructuredOutput
from .errors import ProtocolError, invalid_value


@dataclass
class ToolCall:
    """One call of a tool, as OpenAI's message carries it (`arguments`: JSON text)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry (with its `index` in a streamed delta)."""
        body: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


@dataclass
class ToolRequest:
    """A chat request's tools and its `tool_choice` ("none", "auto", "required", or "named": `name`)."""

    tools: list[dict[str, Any]]
    choice: str
    name: str | None = None
    parallel: bool = True

    def function(self, name: str) -> dict[str, Any]:
        """The `function` object of the tool named `name`."""
        return next(tool["function"] for tool in self.tools if tool["function"]["name"] == name)

    def constraint(self) -> StructuredOutput | None:
        """The grammar that enforces `required` or a named function (None for `auto` and `none`)."""
        if self.choice == "named":
            return StructuredOutput(json=self.function(self.name).get("parameters") or {"type": "object"},
                                    disable_any_whitespace=True)
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                                   "parameters": tool["function"].get("parameters") or
                                                   {"type": "object"}},
                  "required": ["name", "parameters"], "additionalProperties": False} for tool in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput(json=schema, disable_any_whitespace=True)

    @property
    def finish_reason(self) -> str:
        """A choice's finish_reason when it made calls (vLLM's: "stop" for a named function)."""
        return "stop" if self.choice == "named" else "tool_calls"


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The body's tools and tool_choice (None without tools; with tool_choice "none" the tools are still rendered by
    the chat template, and no call is parsed); a 400 naming the field for anything malformed."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid_value("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise invalid_value(f"'tool_choice' {json.dumps(choice)} needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise invalid_value("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools")
    names = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise invalid_value(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}", where)
        function = tool["function"]
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise invalid_value(f"'{where}.function.name' must be a non-empty string", where)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid_value(f"'{where}.function.parameters' must be a JSON schema object", where)
        names.append(function["name"])
    if len(set(names)) != len(names):
        raise invalid_value(f"'tools' names must be distinct, got {names}", "tools")
    if choice is None or choice == "auto":
        request = ToolRequest(tools, "auto")
    elif choice == "none":
        return ToolRequest(tools, "none")
    elif choice == "required":
        request = ToolRequest(tools, "required")
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        if choice["function"]["name"] not in names:
            raise invalid_value(f"'tool_choice' names {choice['function']['name']!r}, which is not among 'tools' "
                           f"{names}", "tool_choice")
        request = ToolRequest(tools, "named", choice["function"]["name"])
    else:
        raise invalid_value("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                       f"{{'name': ...}}}}, got {json.dumps(choice)}", "tool_choice")
    request.parallel = True if parallel is None else parallel
    return request


def response_template(tokenizer: Any, model: Any) -> dict | None:
    """transformers' response template for this model (what `transformers serve` parses tool calls with): the
    tokenizer's own `response_template`, else transformers' template for the model's type; None when it has
    neither."""
    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return own
    from transformers.cli.serving.utils import get_response_template

    # transformers 5.24 takes the model, 5.25 its config.
    takes_model = "model" in inspect.signature(get_response_template).parameters
    return get_response_template(tokenizer, model if takes_model else model.config)


def parser_template(tokenizer: Any, model: Any) -> dict:
    """transformers' response template that finds this model's tool calls (tool_choice "auto"); a 400 without."""
    template = response_template(tokenizer, model)
    if template is None:
        raise ProtocolError(
            f"tool_choice 'auto' needs a parser of this model's tool calls, and transformers has none for it (no "
            f"response_template on its tokenizer, none for model type {model.config.model_type!r}); "
            "use tool_choice 'required' or a named function, which a grammar enforces for any model",
            param="tool_choice", code="unsupported_parameter")
    return template



@dataclass
class Extracted:
    """What a choice's new text holds: message content, reasoning, and tool calls completed."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallExtractor:
    """One choice's text split into content and tool calls, as it grows. `required` / named: the text is the
    grammar's JSON, parsed when the choice ends. `auto`: transformers' `ResponseParser` over the text with special
    tokens kept (markers such as `<tool_call>` may be special tokens)."""

    def __init__(self, request: ToolRequest, template: dict | None = None, prefix: str = "") -> None:
        self.request = request
        self._text = ""
        self._parser = None
        self.made_calls = False
        if request.choice == "auto":
            from transformers.utils.chat_parsing import ResponseParser

            self._parser = ResponseParser(template, prefix=prefix, tools=request.tools)

    def feed(self, raw_text: str) -> Extracted:
        """The new text of the choice (special tokens kept)."""
        if self._parser is None:
            self._text += raw_text
            return Extracted()
        return self._events(self._parser.feed(raw_text))

    def finish(self) -> Extracted:
        """At the choice's end: what is left (every call of `required` / named, the parser's last region)."""
        if self._parser is not None:
            _, events = self._parser.finalize()
            return self._events(events)
        text = self._text
        if self.request.choice == "named":
            try:
                json.loads(text)
            except ValueError:  # cut short by max_tokens: no call, the text kept as content
                return Extracted(content=text)
            return self._made([ToolCall(self.request.name, text)])
        try:
            items = json.loads(text)
        except ValueError:
            return Extracted(content=text)
        return self._made([ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                           for item in items])

    def _made(self, calls: list[ToolCall]) -> Extracted:
        self.made_calls = self.made_calls or bool(calls)
        return Extracted(calls=calls)

    def _events(self, events: list[dict]) -> Extracted:
        out = Extracted()
        for event in events:
            kind, name = event.get("type"), event.get("field")
            if kind == "region_chunk" and not event.get("dirty"):
                if name == "content":
                    out.content += event.get("text") or ""
                elif name in ("reasoning_content", "thinking", "reasoning"):
                    out.reasoning += event.get("text") or ""
            elif kind == "region_close" and name == "tool_calls":
                function = (event.get("value") or {}).get("function") or {}
                arguments = function.get("arguments", {})
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                if isinstance(function.get("name"), str):
                    out.calls.append(ToolCall(function["name"], arguments))
        self.made_calls = self.made_calls or bool(out.calls)
        return out
