"""A request's prompts, ready for the engine: text encoded, chat messages through the tokenizer's chat template (with
the request's tools), every prompt checked against the vocabulary and the context (a chat request's max_tokens filled
in from the room left), and `bad_words` as token ids. Each problem is a `ProtocolError` naming the field."""

from __future__ import annotations

from typing import Any

from .protocol import ProtocolError, SamplingParams


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Plain text with the tokenizer's usual special tokens, as `python -m cbcore generate` encodes it."""
    ids = list(tokenizer(text)["input_ids"])
    if not ids:
        raise ProtocolError("the prompt encodes to no tokens", param="prompt", code="invalid_value")
    return ids


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The chat template's text (it carries its own special tokens, so none are added when encoding), with the
    tools rendered as the template renders them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ProtocolError("this model's tokenizer has no chat template; use /v1/completions", param="messages",
                            code="no_chat_template")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # jinja's TemplateError and friends: the template refused these messages
        raise ProtocolError(f"the chat template refused the messages: {error}", param="messages",
                            code="invalid_value") from error
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ProtocolError("the messages encode to no tokens", param="messages", code="invalid_value")
    return ids


def fit(prompts: list[list[int]], params: SamplingParams, vocab_size: int, max_context: int) -> SamplingParams:
    """Check the prompts against the vocabulary and the context; fill in max_tokens when none was given (chat):
    what is left of the context after the longest prompt."""
    for prompt in prompts:
        bad = next((t for t in prompt if t >= vocab_size), None)
        if bad is not None:
            raise ProtocolError(f"token id {bad} is outside the vocabulary (size {vocab_size})",
                                param="prompt", code="invalid_value")
    longest = max(len(p) for p in prompts)
    room = max_context - longest
    if room < 1:
        raise ProtocolError(
            f"This model's maximum context length is {max_context} tokens, but the prompt has {longest} "
            "tokens, leaving no room to generate", param="messages" if params.max_tokens is None else "prompt",
            code="context_length_exceeded")
    if params.max_tokens is None:
        params.max_tokens = room
    elif longest + params.max_tokens > max_context:
        raise ProtocolError(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{longest + params.max_tokens} tokens ({longest} in the prompt, {params.max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.", param="max_tokens",
            code="context_length_exceeded")
    return params


def bad_word_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids as the tokenizer encodes it alone and after a space (mid-text, most tokenizers
    fold the space into the word's first token), as vLLM tokenizes `bad_words`."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word, " " + word):
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
