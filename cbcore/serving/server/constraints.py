"""A request's structured output, from whichever of the peers' fields a client sends: OpenAI's `response_format`
(`json_object`, `json_schema`), vLLM's `structured_outputs` object and its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`, SGLang's `json_schema` / `regex` / `ebnf`. At most one constraint per request;
what each field means is cbcore/structured_output.py's `StructuredOutput`.

OpenAI's `strict` on a `json_schema`: properties the schema does not list are never generated whatever its value
(xgrammar's strict mode), which is what `strict: true` promises; `strict: false` allows what it allows, so both
give text that validates against the schema.
"""

from __future__ import annotations

import json
from typing import Any

from ...grammar import GrammarError
from ...structured_output import StructuredOutput, structured_output
from .errors import ProtocolError, invalid_value
from .protocol import SamplingParams
from .tools import ToolRequest

# vLLM's `structured_outputs` fields that cbcore's grammar engine honours as they are, and those that change nothing
# with xgrammar (there is no fallback engine; xgrammar's strict mode already allows no unlisted property).
_STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace")
_NEUTRAL_FIELDS = ("disable_fallback", "disable_additional_properties")
# The request fields that carry a constraint, in the order a 400 names them.
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "json_schema", "guided_regex", "regex",
                     "guided_choice", "guided_grammar", "ebnf")
# Grammar backends a client may name: cbcore has one.
_BACKENDS = (None, "auto", "xgrammar")


def _response_format(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid_value("'response_format' must be an object with a 'type'", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", spec.get("json_schema")), dict):
            raise invalid_value("'response_format.json_schema' must be an object with the JSON schema under 'schema'",
                           "response_format.json_schema")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid_value("'response_format.json_schema.strict' must be a boolean", "response_format.json_schema")
        return StructuredOutput(json=spec.get("schema", spec.get("json_schema")))
    if kind == "structural_tag":
        return StructuredOutput(structural_tag=value)
    raise invalid_value(f"'response_format.type' must be 'text', 'json_object', 'json_schema' or 'structural_tag', got "
                   f"{kind!r}", "response_format.type")


def _structured_outputs(value: Any) -> StructuredOutput:
    if not isinstance(value, dict):
        raise invalid_value("'structured_outputs' must be an object", "structured_outputs")
    if value.get("whitespace_pattern") is not None:
        raise ProtocolError("'structured_outputs.whitespace_pattern' is not supported by this server: it is an "
                            "outlines option and cbcore's grammar engine is xgrammar; use disable_any_whitespace",
                            param="structured_outputs", code="unsupported_parameter")
    backend = value.get("backend", value.get("_backend"))
    if backend not in _BACKENDS:
        raise ProtocolError(f"'structured_outputs.backend': cbcore's grammar engine is xgrammar, got {backend!r}",
                            param="structured_outputs", code="unsupported_parameter")
    unknown = sorted(set(value) - set(_STRUCTURED_FIELDS) - set(_NEUTRAL_FIELDS) -
                     {"whitespace_pattern", "backend", "_backend"})
    if unknown:
        raise ProtocolError(f"'structured_outputs': unknown fields {unknown}", param="structured_outputs",
                            code="unsupported_parameter")
    given = {name: value[name] for name in _STRUCTURED_FIELDS if value.get(name) is not None}
    return _checked(given, "structured_outputs")


def _checked(given: dict, param: str) -> StructuredOutput:
    try:
        return structured_output(given, f"'{param}'")
    except (TypeError, ValueError) as error:
        raise invalid_value(str(error), param) from None


def _json_value(value: Any, param: str) -> Any:
    """A schema given as an object or as its JSON text (vLLM's `guided_json` and SGLang's `json_schema` take both)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as error:
            raise invalid_value(f"'{param}' is not valid JSON: {error}", param) from None
    return value


def request_constraint(body: dict) -> StructuredOutput | None:
    """The body's constraint (None when it has none); a 400 naming the field for a malformed one or for two."""
    found: list[tuple[str, StructuredOutput]] = []
    if body.get("response_format") is not None:
        constraint = _response_format(body["response_format"])
        if constraint is not None:
            found.append(("response_format", constraint))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    simple = {"guided_json": "json", "json_schema": "json", "guided_regex": "regex", "regex": "regex",
              "guided_choice": "choice", "guided_grammar": "grammar", "ebnf": "grammar"}
    for name, kind in simple.items():
        value = body.get(name)
        if value is None:
            continue
        if kind == "json":
            value = _json_value(value, name)
        found.append((name, _checked({kind: value}, name)))
    backend = body.get("guided_decoding_backend")
    if backend not in _BACKENDS:
        raise ProtocolError(f"'guided_decoding_backend': cbcore's grammar engine is xgrammar, got {backend!r}",
                            param="guided_decoding_backend", code="unsupported_parameter")
    if len(found) > 1:
        raise invalid_value(f"give one constraint per request, got {[name for name, _ in found]}", found[1][0])
    return found[0][1] if found else None


def constrain(manager: Any, params: SamplingParams, body: dict, tools: ToolRequest | None = None) -> None:
    """The request's constraint (constraints.py; or the grammar of tool_choice required / a named function) on
    `params`, compiled now so that one that does not compile is a 400 naming its field (compiled grammars are
    cached: a schema sent again costs nothing)."""
    constraint = request_constraint(body)
    source = next((name for name in CONSTRAINT_FIELDS if body.get(name) is not None), None)
    forced = tools.constraint() if tools is not None else None
    if forced is not None:
        if constraint is not None:
            raise ProtocolError(f"tool_choice {tools.choice!r} (a function or 'required') constrains the output to "
                                f"tool calls; leave '{source}' out", param=source, code="invalid_value")
        constraint, source = forced, "tools"
    if params.stop and tools is not None and tools.choice != "none":
        raise ProtocolError("'stop' with tools is not supported: a stop string could cut a tool call short; leave "
                            "it out", param="stop", code="unsupported_parameter")
    if constraint is None:
        return
    try:
        manager.grammar_engine().compile(constraint)
    except GrammarError as error:
        reason = str(error).split("does not compile: ", 1)[-1]
        raise ProtocolError(f"'{source}' does not compile ({constraint.kind}): {reason}", param=source,
                            code="invalid_value") from None
    params.structured_output, params.constraint_field = constraint, source
