"""Every request field that OpenAI's API or vLLM's / SGLang's OpenAI-compatible servers accept on `/v1/completions`
and `/v1/chat/completions`, and what cbcore's server does with it: one table, `FIELDS`.

A client written for one of those servers sends their fields; one that changes the result and is dropped in silence
gives unconstrained or unpenalised text with no error. So each known field is, on each endpoint:

| treatment | what the server does |
|---|---|
| `HONOURED` | parsed and applied (protocol.py checks its type and range) |
| `NO_OP` | accepted and not used, because it changes nothing in the generated tokens or text (the row says why) |
| `DEFAULT_ONLY` | accepted only at the values listed, which are what cbcore does anyway; any other value is a 400 |
| `REFUSED` | a 400 whenever it is set (null is the same as absent, as in OpenAI's API) |

A field the table lists only for the other endpoint (`messages` sent to `/v1/completions`, say) is a 400 naming the
endpoint it belongs to. A field no peer knows is ignored, as OpenAI's and vLLM's servers ignore it, with one log
line per field name.

Sources: OpenAI's API reference (completions, chat completions), vLLM's `CompletionRequest` /
`ChatCompletionRequest` (including the `guided_*` fields of its older releases), SGLang's request models.
"""

from __future__ import annotations

import enum
import json
import logging
import numbers
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("cbcore.serve")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BOTH = frozenset({COMPLETIONS, CHAT})


class Treatment(enum.Enum):
    """What the server does with a known field (see the module's table)."""

    HONOURED = "honoured"
    NO_OP = "accepted, changes nothing"
    DEFAULT_ONLY = "accepted at its default only"
    REFUSED = "refused"


@dataclass(frozen=True)
class Field:
    """One known field on some endpoints. `accepted`: the values a DEFAULT_ONLY field may take (null always may);
    `same_as`: another field whose value this one may also equal (`best_of` = `n`). `why`: for NO_OP, why nothing
    changes; for the others, what cbcore does instead, quoted in the 400."""

    name: str
    treatment: Treatment
    endpoints: frozenset[str] = BOTH
    accepted: tuple[Any, ...] = ()
    same_as: str | None = None
    why: str = ""


H, N, D, R = Treatment.HONOURED, Treatment.NO_OP, Treatment.DEFAULT_ONLY, Treatment.REFUSED
_CMPL, _CHAT = frozenset({COMPLETIONS}), frozenset({CHAT})
_SAMPLING = ("cbcore samples with temperature, top_p, top_k, min_p, the penalties, logit_bias and bad_words, and no "
             "other logits processor")
_TOOLS = "it is OpenAI's deprecated form of 'tools' and 'tool_choice', which this server takes instead"
_ONE_ENGINE = "cbcore serves one engine on one machine, with no KV transfer or routing between engines"
_NO_PARSER = "SGLang splits reasoning out only with a reasoning parser; cbcore has none: the text is whole either way"
_TEXT = "the text is decoded with special tokens skipped and no stop string kept, as cbcore always does"

_ROWS = (
    # ---- OpenAI: both endpoints
    Field("model", H),
    Field("max_tokens", H),
    Field("temperature", H),
    Field("top_p", H),
    Field("n", H),
    Field("stop", H),
    Field("stream", H),
    Field("stream_options", H),
    Field("seed", H),
    Field("logprobs", H),
    Field("user", H, why="checked to be a string; an end-user id for the provider's abuse monitoring"),
    Field("presence_penalty", H),
    Field("frequency_penalty", H),
    Field("logit_bias", H),
    Field("response_format", H),
    # ---- OpenAI: completions
    Field("prompt", H, _CMPL),
    Field("best_of", D, _CMPL, accepted=(1,), same_as="n", why="cbcore returns every sample it draws (best_of = n)"),
    Field("echo", H, _CMPL),
    Field("suffix", D, _CMPL, accepted=("",), why="cbcore has no fill-in-the-middle"),
    # ---- OpenAI: chat
    Field("messages", H, _CHAT),
    Field("max_completion_tokens", H, _CHAT),
    Field("top_logprobs", H, _CHAT),
    Field("tools", H, _CHAT),
    Field("tool_choice", H, _CHAT),
    Field("functions", D, _CHAT, accepted=([],), why=_TOOLS),
    Field("function_call", D, _CHAT, accepted=("none", "auto"), why=_TOOLS),
    Field("parallel_tool_calls", H, _CHAT),
    Field("modalities", D, _CHAT, accepted=(["text"],), why="cbcore generates text only"),
    Field("audio", R, _CHAT, why="cbcore generates text only"),
    Field("reasoning_effort", R, _CHAT, why="cbcore passes nothing of it to the chat template or the model"),
    Field("verbosity", R, _CHAT, why="cbcore passes nothing of it to the chat template or the model"),
    Field("web_search_options", R, _CHAT, why="cbcore has no web search"),
    Field("prediction", N, _CHAT, why="a predicted output only speeds OpenAI's generation up; the text is the same"),
    Field("store", N, _CHAT, why="whether OpenAI keeps the completion for its dashboards; cbcore keeps nothing"),
    Field("metadata", N, _CHAT, why="tags for stored completions; cbcore stores none"),
    Field("service_tier", N, _CHAT, why="OpenAI's latency and pricing tier; cbcore has one"),
    Field("prompt_cache_key", N, _CHAT, why="routes to OpenAI's prompt caches; cached or not, the tokens are the same"),
    Field("prompt_cache_retention", N, _CHAT, why="how long OpenAI keeps a cached prompt; the tokens are the same"),
    Field("safety_identifier", N, _CHAT, why="an end-user id for the provider's abuse monitoring"),
    # ---- vLLM's extra sampling fields (both endpoints)
    Field("top_k", H),
    Field("priority", H),
    Field("return_tokens_as_token_ids", H),
    Field("min_p", H),
    Field("repetition_penalty", H),
    Field("use_beam_search", D, accepted=(False,), why="cbcore samples; it has no beam search"),
    Field("length_penalty", D, accepted=(1,), why="it scores beams, and cbcore has no beam search"),
    Field("stop_token_ids", H),
    Field("include_stop_str_in_output", D, accepted=(False,), why=_TEXT),
    Field("ignore_eos", H),
    Field("min_tokens", H),
    Field("skip_special_tokens", D, accepted=(True,), why=_TEXT),
    Field("spaces_between_special_tokens", D, accepted=(True,), why=_TEXT),
    Field("truncate_prompt_tokens", R, why="a prompt is never truncated: one longer than the context is a 400"),
    Field("truncation_side", R, why="a prompt is never truncated: one longer than the context is a 400"),
    Field("allowed_token_ids", R, why=_SAMPLING),
    Field("bad_words", H),
    # cbcore's own (vLLM sets it per server): "raw" or "processed" logprobs for this request.
    Field("logprobs_mode", H),
    Field("logits_processors", R, why=_SAMPLING),
    Field("watermarking", D, accepted=(False,), why="cbcore does not watermark its text"),
    Field("repetition_detection", R, why="a choice ends at EOS, max_tokens or a stop string only"),
    Field("thinking_token_budget", R, why="cbcore does not count or limit reasoning tokens"),
    Field("prompt_logprobs", R, why="a prompt's logprobs come with 'echo' and 'logprobs' on /v1/completions"),
    Field("logprob_token_ids", R, why="logprobs are those of the chosen and the most likely tokens only"),
    Field("return_token_ids", D, accepted=(False,), why="the response carries text (and logprobs), not token ids"),
    Field("return_prompt_text", D, accepted=(False,), why="the response does not repeat the prompt"),
    Field("return_token_offsets", N, why="vLLM uses it on its render endpoints only"),
    Field("return_mm_kwargs", N, why="vLLM uses it on its render endpoints only"),
    Field("routed_experts_prompt_start", N, why="it trims routed-expert data, which cbcore does not return"),
    Field("stream_interval", N, why="how many tokens a streamed chunk carries; the text is the same"),
    Field("request_id", N, why="cbcore names the response with an id of its own; the text is the same"),
    Field("session_id", N, why="a stable id of a conversation, for routing and logs; the text is the same"),
    Field("cache_salt", R, why="cbcore's prefix cache is shared by every request; it cannot isolate one"),
    Field("kv_transfer_params", R, why=_ONE_ENGINE),
    Field("ec_transfer_params", R, why=_ONE_ENGINE),
    Field("vllm_xargs", D, accepted=({},), why="cbcore has no request extensions"),
    Field("structured_outputs", H),
    Field("guided_json", H),
    Field("guided_regex", H),
    Field("guided_choice", H),
    Field("guided_grammar", H),
    Field("guided_decoding_backend", D, accepted=("xgrammar", "auto"), why="cbcore's grammar engine is xgrammar"),
    Field("guided_whitespace_pattern", R, why="it is an outlines option and cbcore's grammar engine is xgrammar"),
    # ---- vLLM: completions
    Field("add_special_tokens", D, _CMPL, accepted=(True,),
          why="a text prompt is encoded with the tokenizer's special tokens, as transformers encodes it"),
    Field("prompt_embeds", R, _CMPL, why="a prompt is text or token ids"),
    # ---- vLLM: chat
    Field("add_special_tokens", D, _CHAT, accepted=(False,),
          why="the chat template writes its own special tokens, so none are added when its text is encoded"),
    Field("echo", D, _CHAT, accepted=(False,), why="the response holds the generated message only"),
    Field("add_generation_prompt", D, _CHAT, accepted=(True,),
          why="the chat template is applied with the assistant's generation prompt"),
    Field("continue_final_message", D, _CHAT, accepted=(False,),
          why="the chat template is applied with a new assistant turn"),
    Field("documents", R, _CHAT, why="the chat template is given the messages only"),
    Field("chat_template", R, _CHAT, why="the tokenizer's own chat template is used"),
    Field("chat_template_kwargs", D, _CHAT, accepted=({},), why="the chat template is given the messages only"),
    Field("mm_processor_kwargs", D, _CHAT, accepted=({},), why="messages are text only"),
    Field("media_io_kwargs", D, _CHAT, accepted=({},), why="messages are text only"),
    Field("include_reasoning", D, _CHAT, accepted=(True,),
          why="cbcore has no reasoning parser: the message holds all the generated text"),
    # ---- SGLang's extra fields (both endpoints)
    Field("regex", H),
    Field("ebnf", H),
    Field("json_schema", H),
    Field("stop_regex", R, why="stop strings are matched literally"),
    Field("no_stop_trim", D, accepted=(False,), why=_TEXT),
    Field("lora_path", R, why="cbcore serves the model's own weights, with no LoRA adapters"),
    Field("custom_logit_processor", R, why=_SAMPLING),
    Field("custom_params", R, why=_SAMPLING),
    Field("session_params", R, why="each request is a prompt of its own; cbcore has no sessions"),
    Field("rid", N, why="cbcore names the response with an id of its own; the text is the same"),
    Field("extra_key", R, why="cbcore's prefix cache is keyed by tokens only; it cannot isolate a request"),
    Field("return_hidden_states", D, accepted=(False,), why="the response carries text (and logprobs) only"),
    Field("return_routed_experts", D, accepted=(False,), why="the response carries text (and logprobs) only"),
    Field("return_cached_tokens_details", D, accepted=(False,), why="the response carries text (and logprobs) only"),
    Field("bootstrap_host", R, why=_ONE_ENGINE),
    Field("bootstrap_port", R, why=_ONE_ENGINE),
    Field("bootstrap_room", R, why=_ONE_ENGINE),
    Field("data_parallel_rank", R, why=_ONE_ENGINE),
    Field("routed_dp_rank", R, why=_ONE_ENGINE),
    # ---- SGLang: chat
    Field("separate_reasoning", N, _CHAT, why=_NO_PARSER),
    Field("stream_reasoning", N, _CHAT, why=_NO_PARSER),
    Field("return_prompt_token_ids", D, _CHAT, accepted=(False,), why="the response does not repeat the prompt"),
    Field("return_meta_info", D, _CHAT, accepted=(False,), why="the response carries text (and logprobs) only"),
    Field("input_ids", R, _CHAT, why="a chat prompt is always the chat template applied to the messages"),
)

FIELDS: dict[tuple[str, str], Field] = {(endpoint, row.name): row for row in _ROWS for endpoint in row.endpoints}
"""(endpoint, field name) -> its row."""

KNOWN_NAMES = frozenset(row.name for row in _ROWS)

_logged_unknown: set[str] = set()  # unknown field names already logged (one line each, not one per request)


def _same(value: Any, default: Any) -> bool:
    """JSON equality: a number equals a number of the same value (1 and 1.0), but a boolean only a boolean (Python's
    `True == 1` would let `"min_tokens": true` through)."""
    if isinstance(value, bool) or isinstance(default, bool):
        return isinstance(value, bool) and isinstance(default, bool) and value == default
    if isinstance(value, numbers.Real) and isinstance(default, numbers.Real):
        return value == default
    if isinstance(value, list) and isinstance(default, list):
        return len(value) == len(default) and all(_same(v, d) for v, d in zip(value, default))
    if isinstance(value, dict) and isinstance(default, dict):
        return value.keys() == default.keys() and all(_same(value[k], default[k]) for k in value)
    return type(value) is type(default) and value == default


def _json(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def refusal(body: dict[str, Any], endpoint: str) -> tuple[str, str] | None:
    """The first field of `body` this endpoint cannot honour, as (name, message for the 400), or None. Fields no
    peer knows are logged once per name and otherwise ignored."""
    for name, value in body.items():
        row = FIELDS.get((endpoint, name))
        if row is None:
            if name in KNOWN_NAMES:
                if value is None:
                    continue
                other = next(e for e in (COMPLETIONS, CHAT) if (e, name) in FIELDS)
                return name, (f"'{name}' is a field of {other}, not of {endpoint}; leave it out or send the request "
                              f"to {other}")
            if name not in _logged_unknown:
                _logged_unknown.add(name)
                logger.warning("cbcore serve: ignoring the unknown request field '%s' (a field of neither OpenAI's, "
                               "vLLM's nor SGLang's API)", name)
            continue
        if value is None or row.treatment in (Treatment.HONOURED, Treatment.NO_OP):
            continue
        if row.treatment is Treatment.REFUSED:
            return name, f"'{name}' is not supported by this server: {row.why}; leave it out (got {_json(value)})"
        if any(_same(value, default) for default in row.accepted):
            continue
        if row.same_as is not None and _same(value, body.get(row.same_as) or 1):
            continue
        allowed = " or ".join(_json(default) for default in row.accepted)
        if row.same_as is not None:
            allowed += f" or the value of '{row.same_as}'"
        return name, (f"'{name}': {_json(value)} is not supported by this server, only {allowed} (the default): "
                      f"{row.why}; leave it out or send {allowed}")
    return None
