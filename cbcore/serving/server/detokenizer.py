"""Incremental detokenization of one choice, and stop strings matched on its text.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas. A byte-level tokenizer can split one
character over several tokens; decoding such a prefix ends in U+FFFD, so the text is held back until the character
is complete (the read-offset scheme of Hugging Face TGI / vLLM: decode a short window before and after the new
tokens and emit the difference). Concatenated deltas equal `tokenizer.decode(all_tokens, skip_special_tokens=True)`
for byte-level BPE tokenizers.

`StopMatcher` looks for the stop strings in the text as it grows and trims the text at the first match (the stop
string is not part of the output, as OpenAI does). While streaming it holds back the last `len(longest stop) - 1`
characters, which could be the start of a stop string, so text that a match later removes is never sent.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for a growing token list; `push(tokens)` takes all tokens so far (a manager snapshot)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        """`skip_special_tokens=False` keeps special tokens' text (a tool-call parser looks for markers that some
        tokenizers hold as special tokens)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = 0  # tokens before this are already in the text

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)

    def push(self, tokens: list[int], final: bool = False) -> str:
        """The new text since the last call. `tokens` extends the previous list. With `final`, a character left
        incomplete (the output ended inside it) is emitted as U+FFFD rather than held back forever."""
        self.tokens = tokens
        if self._read_offset >= len(tokens):
            return ""
        before = self._decode(tokens[self._prefix_offset : self._read_offset])
        after = self._decode(tokens[self._prefix_offset :])
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""  # nothing visible yet, or a character still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(tokens)
        return after[len(before) :]

    def token_text(self, token_id: int) -> str:
        """One token's own text (for logprobs): may be a piece of a character."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class StopMatcher:
    """Accumulates a choice's text, finds stop strings, and says how much text is safe to send."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0  # characters of `text` already released
        self.stopped = False

    def feed(self, delta: str) -> None:
        """Add text; on a stop string, trim the text at its start and mark the choice stopped."""
        if self.stopped or not delta:
            return
        search_from = max(0, len(self.text) - self.hold)
        self.text += delta
        first = -1
        for stop in self.stops:
            index = self.text.find(stop, search_from)
            if index != -1 and (first == -1 or index < first):
                first = index
        if first != -1:
            self.text = self.text[:first]
            self.stopped = True

    def release(self, final: bool = False) -> str:
        """Text that can be sent now: everything when stopped or final, else all but the held-back tail."""
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent : end]
        self.sent = end
        return out
