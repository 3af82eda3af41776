"""OpenAI request bodies for `/v1/completions` and `/v1/chat/completions`: parsing and validation.

A body is checked field by field before anything reaches the engine; the first problem raises `ProtocolError`,
which the app answers with OpenAI's error body `{"error": {"message", "type", "param", "code"}}` (400 unless said).

Which fields are read, accepted, or refused is one table, `fields.FIELDS`: every field of OpenAI's API and of vLLM's
and SGLang's OpenAI-compatible servers is honoured here, accepted where it changes nothing, or answered 400 naming
it, never silently dropped; a field none of them knows is ignored, as they ignore it.

Logprobs are the model's own, as OpenAI and vLLM (its default `raw_logprobs`) report them: log-softmax of the raw
logits, before temperature, top-k or top-p, for the chosen token and for the `top_logprobs` (chat, 0-20) or `logprobs`
(completions, 0-5) most likely tokens of each step. So they are the same whatever the temperature, greedy included.

`seed`: each choice draws its tokens from a generator of its own, seeded with `seed + choice index` (the manager's
per-request `seed`), so the same request with the same seed gives the same text whatever else the server is doing;
without `seed`, samples come from the server's shared generator (`--seed`).

`priority` (vLLM's extra field, an int, lower first, default 0): the request's place in the waiting queue and
among preemption victims (cbcore/scheduler.py); every choice of a request has its priority.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from ...sampling import LOGPROBS_MODES
from ...sampling_controls import check_controls
from ...structured_output import StructuredOutput
from .errors import ProtocolError
from .fields import CHAT, COMPLETIONS, refusal
from .messages import chat_messages

# OpenAI caps `stop` at 4 sequences; `n` and `top_logprobs` at 128 and 20.
MAX_STOP_SEQUENCES = 4
MAX_N = 128


@dataclass
class SamplingParams:
    """What the engine is asked for one prompt; shared by every choice (`n`) of it."""

    max_tokens: int | None  # None: until EOS or the end of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    n: int = 1
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False  # the chosen token's logprob for every generated token
    top_logprobs: int = 0  # and this many most likely alternatives at each step
    seed: int | None = None  # choice i draws from its own generator seeded with seed + i
    priority: int = 0  # lower is scheduled first
    tokens_as_ids: bool = False  # vLLM's `return_tokens_as_token_ids`: logprob tokens as "token_id:<id>"
    # The sampling controls (cbcore/sampling_controls.py), checked; `bad_words` are text, tokenized by the app.
    controls: dict[str, Any] = field(default_factory=dict)
    bad_words: list[str] = field(default_factory=list)
    logprobs_mode: str | None = None  # None: the server's (--logprobs-mode)
    echo: bool = False  # completions: the prompt (and its logprobs) before the generated text
    score_only: bool = False  # max_tokens=0 with echo: the prompt's logprobs only, nothing generated
    # What the text must follow (constraints.py, or tools.py for tool_choice required / a named function), and the
    # field that asked for it (named by a 400 when it does not compile).
    structured_output: StructuredOutput | None = None
    constraint_field: str | None = None

    @property
    def greedy(self) -> bool:
        """Whether this request decodes greedily (temperature 0)."""
        return self.temperature == 0.0

    def engine_kwargs(self) -> dict[str, Any]:
        """The manager's per-request kwargs (`per_request_processors=True`). The manager samples every request (its
        generation config has `do_sample=True`), so greedy is `top_k=1`: the warper leaves one finite logit, which
        the sampler's draw then picks with probability 1, exactly the argmax (ties aside, as argmax would take the
        first). Temperature and top_p do not change which logit is largest, so they are left out. `top_logprobs`
        (with logprobs: the model's own) and `priority` are cbcore's kwargs, not processor settings."""
        extra: dict[str, Any] = {"top_logprobs": self.top_logprobs} if self.logprobs else {}
        if self.priority:
            extra["priority"] = self.priority
        extra.update(self.controls)
        if self.logprobs_mode is not None:
            extra["logprobs_mode"] = self.logprobs_mode
        if self.echo and self.logprobs:  # the prompt's logprobs (and as many alternatives) come first
            extra["prompt_logprobs"] = self.top_logprobs
        if self.structured_output is not None:
            extra["structured_output"] = self.structured_output
        if self.greedy:
            return {"top_k": 1, **extra}
        # Only what differs from the manager's own config (temperature 1, top_p 1, no top_k): a step whose rows all
        # carry no override skips the per-row processor loop entirely.
        kwargs = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        neutral = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
        return {**{name: value for name, value in kwargs.items() if value != neutral[name]}, **extra}


@dataclass
class CompletionRequest:
    """A parsed `/v1/completions` body: one or more prompts (text or token ids) with the same sampling."""

    model: str | None
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool


@dataclass
class ChatRequest:
    """A parsed `/v1/chat/completions` body: the messages go through the model's chat template."""

    model: str | None
    messages: list[dict[str, Any]]
    params: SamplingParams
    stream: bool
    include_usage: bool


# ------------------------------------------------------------------------------------------------ field checks


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))


def _int_field(body: dict, name: str, low: int | None = None, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise ProtocolError(f"'{name}' must be an integer, got {value!r}", param=name, code="invalid_type")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise ProtocolError(f"'{name}' must be {bounds}, got {value}", param=name, code="invalid_value")
    return value


def _number_field(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value):
        raise ProtocolError(f"'{name}' must be a number, got {value!r}", param=name, code="invalid_type")
    value = float(value)
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ProtocolError(f"'{name}' must be in {bracket}{low:g}, {high:g}], got {value:g}", param=name,
                            code="invalid_value")
    return value


def _bool_field(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError(f"'{name}' must be a boolean, got {value!r}", param=name, code="invalid_type")
    return value


def _refuse_unsupported(body: dict, endpoint: str) -> None:
    """400 for a known field this endpoint cannot honour (the table in fields.py)."""
    refused = refusal(body, endpoint)
    if refused is not None:
        name, message = refused
        raise ProtocolError(message, param=name, code="unsupported_parameter")


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ProtocolError("'stop' must be a string or a list of strings", param="stop", code="invalid_type")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ProtocolError(f"'stop' holds at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", param="stop",
                            code="invalid_value")
    if any(not s for s in stops):
        raise ProtocolError("'stop' sequences must not be empty", param="stop", code="invalid_value")
    return list(dict.fromkeys(stops))


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ProtocolError("'stream_options' is only allowed when 'stream' is true", param="stream_options",
                            code="invalid_value")
    if not isinstance(options, dict):
        raise ProtocolError("'stream_options' must be an object", param="stream_options", code="invalid_type")
    return _bool_field(options, "include_usage")


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("'model' must be a string", param="model", code="invalid_type")
    return model


def _user(body: dict) -> None:
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ProtocolError("'user' must be a string", param="user", code="invalid_type")


def _sampling(body: dict, max_tokens: int | None, logprobs: bool, top_logprobs: int = 0) -> SamplingParams:
    temperature = _number_field(body, "temperature", 0.0, 2.0)
    top_p = _number_field(body, "top_p", 0.0, 1.0, low_open=True)
    top_k = _int_field(body, "top_k", -1)  # vLLM's extra field; -1 and 0 turn it off
    n = _int_field(body, "n", 1, MAX_N)
    params = SamplingParams(
        tokens_as_ids=_bool_field(body, "return_tokens_as_token_ids"),
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None or top_k < 0 else top_k,
        n=n or 1,
        stop=_stop(body),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        seed=_int_field(body, "seed", 0, 2**62),
        priority=_int_field(body, "priority", -(2**31), 2**31 - 1) or 0,
        controls=_controls(body),
        bad_words=_bad_words(body),
        logprobs_mode=_logprobs_mode(body),
    )
    return params


# The request fields that are sampling controls, under the names cbcore/sampling_controls.py uses.
_CONTROL_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens",
                   "stop_token_ids", "ignore_eos")


def _controls(body: dict) -> dict[str, Any]:
    """The sampling controls the body sets, checked one field at a time (so a 400 names the field). `logit_bias`
    keys are token ids written as JSON strings, as OpenAI's API sends them."""
    controls: dict[str, Any] = {}
    for name in _CONTROL_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if name == "logit_bias":
            if not isinstance(value, dict):
                raise ProtocolError("'logit_bias' must be an object {token id: bias}", param=name, code="invalid_type")
            try:
                value = {int(token): bias for token, bias in value.items()}
            except ValueError:
                raise ProtocolError("'logit_bias' keys must be token ids (integers written as strings)", param=name,
                                    code="invalid_value") from None
        try:
            controls.update(check_controls({name: value}, "request"))
        except TypeError as error:
            raise ProtocolError(f"'{name}': {error}", param=name, code="invalid_type") from error
        except ValueError as error:
            raise ProtocolError(f"'{name}': {error}", param=name, code="invalid_value") from error
    return controls


def _bad_words(body: dict) -> list[str]:
    value = body.get("bad_words")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(word, str) and word for word in value):
        raise ProtocolError("'bad_words' must be a list of non-empty strings", param="bad_words", code="invalid_type")
    return value


def _logprobs_mode(body: dict) -> str | None:
    value = body.get("logprobs_mode")
    if value is not None and value not in LOGPROBS_MODES:
        raise ProtocolError(f"'logprobs_mode' must be one of {list(LOGPROBS_MODES)}, got {value!r}",
                            param="logprobs_mode", code="invalid_value")
    return value


def _body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object", code="invalid_json")
    return body


# ------------------------------------------------------------------------------------------------ the two bodies


def parse_completion(body: Any) -> CompletionRequest:
    """Check a `/v1/completions` body. `prompt`: a string, a list of strings, a list of token ids, or a list of
    lists of token ids (each one prompt). `logprobs`: null (none), or the chosen token's logprob and this many
    (0-5) most likely alternatives at each step."""
    body = _body(body)
    _refuse_unsupported(body, COMPLETIONS)
    prompts = _prompts(body.get("prompt"))
    logprobs = _int_field(body, "logprobs", 0, 5)
    echo = _bool_field(body, "echo")
    max_tokens = _int_field(body, "max_tokens", 0)
    if max_tokens == 0 and not echo:
        raise ProtocolError("'max_tokens' must be >= 1 (0 only with 'echo': the prompt's logprobs alone)",
                            param="max_tokens", code="invalid_value")
    stream = _bool_field(body, "stream")
    _user(body)
    # OpenAI's default max_tokens: 16. Scoring alone (max_tokens 0) runs the prompt and drops the one token it yields.
    params = _sampling(body, 16 if max_tokens is None else max(max_tokens, 1), logprobs is not None, logprobs or 0)
    params.echo = echo
    params.score_only = max_tokens == 0
    return CompletionRequest(
        model=_model(body),
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=_stream_options(body, stream),
    )


def _prompts(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        prompts: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        prompts = [value]
    elif isinstance(value, list) and value:
        prompts = value
    else:
        raise ProtocolError("'prompt' must be a non-empty string, list of strings, list of token ids or list of "
                            "lists of token ids", param="prompt", code="invalid_type")
    for prompt in prompts:
        if isinstance(prompt, str):
            if not prompt:
                raise ProtocolError("'prompt' must not be empty", param="prompt", code="invalid_value")
        elif not (isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt)):
            raise ProtocolError("each prompt must be a non-empty string or a non-empty list of token ids (>= 0)",
                                param="prompt", code="invalid_type")
    return prompts


def parse_chat(body: Any) -> ChatRequest:
    """Check a `/v1/chat/completions` body. `messages`: role + content (a string or a list of text parts).
    `logprobs`: true for the chosen token's logprob; `top_logprobs` (0-20, needs `logprobs`): that many most likely
    alternatives at each step."""
    body = _body(body)
    _refuse_unsupported(body, CHAT)
    messages = chat_messages(body.get("messages"))
    logprobs = _bool_field(body, "logprobs")
    top_logprobs = _int_field(body, "top_logprobs", 0, 20)
    if top_logprobs is not None and not logprobs:
        raise ProtocolError("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs", code="invalid_value")
    max_tokens = _int_field(body, "max_completion_tokens", 1)
    legacy = _int_field(body, "max_tokens", 1)
    if max_tokens is not None and legacy is not None and max_tokens != legacy:
        raise ProtocolError("give one of 'max_tokens' and 'max_completion_tokens'", param="max_tokens",
                            code="invalid_value")
    stream = _bool_field(body, "stream")
    _user(body)
    return ChatRequest(
        model=_model(body),
        messages=messages,
        params=_sampling(body, max_tokens if max_tokens is not None else legacy, logprobs, top_logprobs or 0),
        stream=stream,
        include_usage=_stream_options(body, stream),
    )
