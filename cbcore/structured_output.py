"""Structured output: the constraint a request puts on its generated text, as vLLM's `StructuredOutputsParams` has
it: a JSON schema, any JSON object, a regular expression, a choice among strings, an EBNF grammar, or a structural
tag. Exactly one per request (`add_request(..., structured_output=...)`, a `StructuredOutput` or a dict of its
fields). This module checks and describes the constraint; cbcore/grammar.py compiles it and masks the logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

STRUCTURED_OUTPUT_KWARG = "structured_output"
# The fields naming a kind of constraint; exactly one is set.
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's generated text must be. Set exactly one of:

    - `json`: a JSON schema (a dict, or its JSON text): the text is one JSON value that validates against it.
      Properties the schema does not list are not generated (xgrammar's strict mode, OpenAI's `strict: true`).
    - `json_object=True`: any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    - `regex`: a regular expression the whole text matches.
    - `choice`: a list of strings; the text is exactly one of them.
    - `grammar`: an EBNF grammar in xgrammar's dialect (GBNF: `root ::= ...`).
    - `structural_tag`: an xgrammar structural tag (a dict or its JSON text): free text with tagged regions, each
      constrained by its own schema (tool calls inside a model's own markers).

    `disable_any_whitespace`: JSON without optional whitespace (compact separators), as vLLM's flag.

    The request ends when its text is complete (the grammar then allows only the end-of-sequence token, which is
    generated and ends it) or at `max_new_tokens` (the text may then be cut short, as in every engine)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = False

    @property
    def kind(self) -> str:
        """Which constraint this is (one of `CONSTRAINT_KINDS`)."""
        return next(name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False))

    def cache_key(self) -> tuple:
        """Equal for constraints that compile to the same grammar (a schema's dict and its JSON text included)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        return self.kind, value, self.disable_any_whitespace


def structured_output(value: Any, what: str) -> StructuredOutput:
    """A `StructuredOutput` from the caller's value (one, or a dict of its fields), checked: exactly one kind, each
    of the right type. Raises TypeError / ValueError naming `what` and the field. Whether a schema, regex or grammar
    compiles is the grammar engine's to say (cbcore/grammar.py)."""
    if isinstance(value, StructuredOutput):
        given = {f.name: getattr(value, f.name) for f in fields(StructuredOutput)}
    elif isinstance(value, dict):
        known = {f.name for f in fields(StructuredOutput)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{what}: unknown structured_output fields {unknown}; supported: {sorted(known)}")
        given = dict(value)
    else:
        raise TypeError(f"{what}: structured_output must be a cbcore.StructuredOutput or a dict of its fields, got "
                        f"{type(value).__name__}")
    kinds = [name for name in CONSTRAINT_KINDS if given.get(name) not in (None, False)]
    if len(kinds) != 1:
        raise ValueError(f"{what}: structured_output must set exactly one of {list(CONSTRAINT_KINDS)}, got "
                         f"{kinds or 'none'}")
    for name in ("json_object", "disable_any_whitespace"):
        if name in given and not isinstance(given[name], bool):
            raise TypeError(f"{what}: structured_output.{name} must be True or False, got {given[name]!r}")
    for name in ("json", "structural_tag"):
        item = given.get(name)
        if item is not None and not isinstance(item, (dict, str)):
            raise TypeError(f"{what}: structured_output.{name} must be a dict or its JSON text, got "
                            f"{type(item).__name__}")
        if isinstance(item, str):
            try:
                json.loads(item)
            except ValueError as error:
                raise ValueError(f"{what}: structured_output.{name} is not valid JSON: {error}") from None
    for name in ("regex", "grammar"):
        item = given.get(name)
        if item is not None and (not isinstance(item, str) or not item):
            raise TypeError(f"{what}: structured_output.{name} must be a non-empty str, got {item!r}")
    choice = given.get("choice")
    if choice is not None:
        if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
            raise TypeError(f"{what}: structured_output.choice must be a non-empty list of str, got {choice!r}")
        if not all(isinstance(item, str) and item for item in choice):
            raise TypeError(f"{what}: structured_output.choice must hold non-empty strs, got {list(choice)!r}")
        given["choice"] = tuple(choice)
    return StructuredOutput(**given)
