"""A chat request's messages, checked one by one (a 400 names the message and its field): roles, text content
(images and audio parts refused), and the fields the chat template needs for tool use."""

from __future__ import annotations

import json
from typing import Any

from .errors import ProtocolError


def chat_messages(value: Any) -> list[dict[str, Any]]:
    """A chat request's `messages`, checked: each a role and its content (a string, or text parts joined), with an
    assistant's `tool_calls` and a tool result's `tool_call_id` / `name` kept for the chat template."""
    if not isinstance(value, list) or not value:
        raise ProtocolError("'messages' must be a non-empty list", param="messages", code="invalid_type")
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ProtocolError(f"'{where}' must be an object with a string 'role'", param=where, code="invalid_type")
        content = message.get("content")
        extra = _tool_fields(message, where)
        if content is None and "tool_calls" in extra:
            content = ""  # an assistant turn that only called tools
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ProtocolError(f"'{where}.content': only text parts are supported", param=f"{where}.content",
                                        code="unsupported_parameter")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ProtocolError(f"'{where}.content' must be a string or a list of text parts",
                                param=f"{where}.content", code="invalid_type")
        messages.append({"role": message["role"], "content": content, **extra})
    return messages


def _tool_fields(message: dict, where: str) -> dict[str, Any]:
    """A message's tool fields for the chat template: an assistant's `tool_calls` (their JSON `arguments` as
    objects, which chat templates expect), a tool result's `tool_call_id` and `name`."""
    extra: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise ProtocolError(f"'{where}.tool_calls' must be a list", param=f"{where}.tool_calls",
                                code="invalid_type")
        parsed = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ProtocolError(f"'{where}.tool_calls' entries must be {{'function': {{'name', 'arguments'}}}}",
                                    param=f"{where}.tool_calls", code="invalid_type")
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments else {}
                except ValueError:
                    raise ProtocolError(f"'{where}.tool_calls': arguments of {function['name']!r} are not JSON",
                                        param=f"{where}.tool_calls", code="invalid_value") from None
            parsed.append({"id": call.get("id"), "type": "function",
                           "function": {"name": function["name"], "arguments": arguments}})
        extra["tool_calls"] = parsed
    for name in ("tool_call_id", "name"):
        value = message.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise ProtocolError(f"'{where}.{name}' must be a string", param=f"{where}.{name}",
                                    code="invalid_type")
            extra[name] = value
    return extra
