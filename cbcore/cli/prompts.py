"""The prompts of `python -m cbcore generate`: from --prompt, from a JSONL --input file (text, chat messages or token
ids per line), or the built-in list; and their token ids, chat-templated when the tokenizer has a template."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .options import UsageError

# Short, varied chat prompts for a run with no prompts given: arithmetic, facts, code, lists, rewriting, a story.
DEFAULT_PROMPTS = (
    "What is 2+2?",
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for getting better sleep.",
    "Explain in one paragraph what a hash table is.",
    "Translate 'Good morning, how are you?' into Spanish.",
    "Write a haiku about the sea.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
)


@dataclass
class Prompt:
    """One request as the user gave it: exactly one of `text`, `messages` or `input_ids` is set."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    source: str = "--prompt"  # where it came from, for error messages ("prompts.jsonl:3")


def read_jsonl(path: Path) -> list[Prompt]:
    """Parse an input file; a bad line raises UsageError naming the file and line number."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise UsageError(f"cannot read --input {path}: {error.strerror or error}") from error
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from error
        prompts.append(_prompt_from_record(record, where))
    if not prompts:
        raise UsageError(f"--input {path} holds no prompts")
    return prompts


def _prompt_from_record(record: Any, where: str) -> Prompt:
    if not isinstance(record, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(record).__name__}")
    keys = [k for k in ("prompt", "input_ids", "messages") if k in record]
    if len(keys) != 1:
        found = ", ".join(sorted(record)) or "none"
        raise UsageError(f'{where}: needs exactly one of "prompt", "input_ids" or "messages" (found keys: {found})')
    value = record[keys[0]]
    if keys[0] == "prompt":
        if not isinstance(value, str):
            raise UsageError(f'{where}: "prompt" must be a string, got {type(value).__name__}')
        return Prompt(text=value, source=where)
    if keys[0] == "input_ids":
        ok = isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
        if not ok:
            raise UsageError(f'{where}: "input_ids" must be a list of non-negative integers')
        if not value:
            raise UsageError(f'{where}: "input_ids" is empty')
        return Prompt(input_ids=value, source=where)
    if not (isinstance(value, list) and value and all(_is_message(m) for m in value)):
        raise UsageError(f'{where}: "messages" must be a non-empty list of {{"role": str, "content": str}} objects')
    return Prompt(messages=value, source=where)


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def collect_prompts(args: argparse.Namespace) -> list[Prompt]:
    """--prompt texts first, then --input lines; the built-in prompts when neither is given."""
    prompts = [Prompt(text=text, source=f"--prompt #{i + 1}") for i, text in enumerate(args.prompt)]
    if args.input is not None:
        prompts += read_jsonl(args.input)
    if not prompts:
        prompts = [Prompt(text=text, source="built-in prompt") for text in DEFAULT_PROMPTS]
    return prompts


def encode_prompts(prompts: list[Prompt], tokenizer: Any, chat: bool | None) -> list[list[int]]:
    """Token ids for every prompt. Chat-templated text carries its own special tokens, so it is encoded without
    adding more (no second BOS); plain text gets the tokenizer's usual special tokens."""
    has_template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    if chat and not has_template:
        raise UsageError("--chat was given but the tokenizer has no chat template; drop --chat")
    use_chat = has_template if chat is None else chat
    encoded = []
    for prompt in prompts:
        if prompt.input_ids is not None:
            encoded.append(list(prompt.input_ids))
            continue
        if tokenizer is None:
            raise UsageError(
                f"{prompt.source}: the model has no tokenizer, so prompts must be given as token ids "
                '(--input with {"input_ids": [...]} lines)'
            )
        if prompt.messages is not None and not has_template:
            raise UsageError(f'{prompt.source}: "messages" need a chat template, and the tokenizer has none')
        if prompt.messages is not None or use_chat:
            messages = prompt.messages or [{"role": "user", "content": prompt.text}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt.text)["input_ids"]
        if not ids:
            raise UsageError(f"{prompt.source}: the prompt encodes to no tokens")
        encoded.append(list(ids))
    return encoded
