"""OpenAI response bodies: completions and chat completions, whole or as SSE chunks, and their logprobs.

Shapes follow OpenAI's API reference (and what the `openai` client parses): ids `cmpl-…` / `chatcmpl-…`, `created`
in Unix seconds, `object` `text_completion` / `chat.completion` / `chat.completion.chunk`, `usage` with
prompt / completion / total tokens. Logprobs: the chosen token's, and the request's `top_logprobs` (chat) /
`logprobs` (completions) most likely alternatives of each step: chat's `top_logprobs` is a list of {token, logprob,
bytes} (empty when none were asked), completions' a {token text: logprob} per position (null when none were asked).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .detokenizer import IncrementalDetokenizer
from .tools import ToolCall


# What a logprob of -inf (a token the processed distribution dropped) is sent as: JSON has no infinity, and vLLM
# sends this value.
NEG_INF_LOGPROB = -9999.0


def _json_number(logprob: float | None) -> float | None:
    return NEG_INF_LOGPROB if logprob is not None and logprob == float("-inf") else logprob


def new_id(kind: str) -> str:
    """`cmpl-<hex>` for completions, `chatcmpl-<hex>` for chat, as OpenAI names them."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


@dataclass
class ChoiceText:
    """A choice's output as it accumulates (non-streaming responses)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    finish_reason: str | None = None
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def chat_message(text: str, reasoning: str = "", tool_calls: list[ToolCall] = ()) -> dict[str, Any]:
    """A chat choice's message: its content (null when it only called tools, as OpenAI sends it), its tool calls,
    and the reasoning a response template split out (`reasoning_content`, vLLM's field)."""
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not tool_calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = [call.body() for call in tool_calls]
    return message


class ResponseBuilder:
    """Bodies for one request: `kind` is "completion" or "chat"."""

    def __init__(self, kind: str, model: str, tokenizer: Any, logprobs: bool, include_usage: bool,
                 tokens_as_ids: bool = False) -> None:
        self.tokens_as_ids = tokens_as_ids
        self.kind = kind
        self.id = new_id(kind)
        self.created = int(time.time())
        self.model = model
        self.logprobs = logprobs
        self.include_usage = include_usage
        self._detok = IncrementalDetokenizer(tokenizer)

    # --------------------------------------------------------------------------------------------- logprobs ----

    def _text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else self._detok.token_text(token_id)

    @staticmethod
    def _bytes(text: str) -> list[int] | None:
        return None if "\ufffd" in text else list(text.encode("utf-8"))

    def _logprobs(self, token_ids: list[int], logprobs: list[float], offset: int = 0,
                  top: list[tuple[list[int], list[float]]] | None = None) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        texts = [self._text(t) for t in token_ids]
        logprobs = [_json_number(lp) for lp in logprobs]
        # An echoed prompt's first token has no logprob and no alternatives (None).
        alternatives = [
            None if entry is None else [(self._text(t), _json_number(lp)) for t, lp in zip(*entry)]
            for entry in (top or [])
        ] or [None] * len(texts)
        if self.kind == "chat":
            return {"content": [
                {"token": text, "logprob": lp, "bytes": self._bytes(text),
                 "top_logprobs": [{"token": t, "logprob": v, "bytes": self._bytes(t)} for t, v in alts or ()]}
                for text, lp, alts in zip(texts, logprobs, alternatives)
            ]}
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        top_logprobs = [None if alts is None else dict(alts) for alts in alternatives] if top else None
        return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": top_logprobs,
                "text_offset": offsets}

    # ----------------------------------------------------------------------------------------------- whole ----

    def response(self, choices: list[ChoiceText], usage: dict[str, int]) -> dict[str, Any]:
        """The whole (non-streaming) response body."""
        if self.kind == "chat":
            body_choices = [
                {"index": c.index, "message": chat_message(c.text, c.reasoning, c.tool_calls),
                 "logprobs": self._logprobs(c.token_ids, c.logprobs, top=c.top_logprobs),
                 "finish_reason": c.finish_reason}
                for c in choices
            ]
            obj = "chat.completion"
        else:
            body_choices = [
                {"index": c.index, "text": c.text,
                 "logprobs": self._logprobs(c.token_ids, c.logprobs, top=c.top_logprobs),
                 "finish_reason": c.finish_reason}
                for c in choices
            ]
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": body_choices, "usage": usage, "system_fingerprint": None}

    # ---------------------------------------------------------------------------------------------- chunks ----

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "system_fingerprint": None}
        if self.include_usage:
            body["usage"] = None
        return body

    def role_chunk(self, index: int) -> dict[str, Any]:
        """Chat's first chunk of a choice: the assistant role."""
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def delta_chunk(self, index: int, text: str, token_ids: list[int], logprobs: list[float],
                    finish_reason: str | None, text_offset: int = 0,
                    top_logprobs: list[tuple[list[int], list[float]]] | None = None, reasoning: str = "",
                    tool_calls: list[tuple[int, ToolCall]] = ()) -> dict[str, Any]:
        """One streaming chunk: a choice's text delta (with its logprobs), or its finish_reason; for chat, also its
        reasoning and the tool calls completed, each `(index among the choice's calls, call)`."""
        lp = self._logprobs(token_ids, logprobs, text_offset, top_logprobs) if token_ids else None
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text} if text or (finish_reason is None and not tool_calls) else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if tool_calls:
                delta["tool_calls"] = [call.body(index) for index, call in tool_calls]
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        return self._chunk([choice])

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        body = self._chunk([])
        body["usage"] = usage
        return body
