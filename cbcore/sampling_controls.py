"""Per-request sampling controls, applied to a step's emitting rows as tensors: vLLM's `SamplingParams` extras.

A request may carry, as per-request kwargs of `add_request` (no `per_request_processors` needed) or as the server's
fields of the same names:

| kwarg | what it does (vLLM's semantics) |
|---|---|
| `repetition_penalty` | > 0: a logit of a token seen in the prompt or the output is divided by it when positive, multiplied when negative |
| `frequency_penalty` | in [-2, 2]: subtracted once per occurrence of the token in the output |
| `presence_penalty` | in [-2, 2]: subtracted once if the token occurs in the output |
| `logit_bias` | {token id: bias in [-100, 100]}: added to the logit |
| `min_p` | in [0, 1]: tokens less likely than `min_p` times the most likely one are dropped (after temperature) |
| `min_tokens` | >= 0: the request's EOS and stop tokens are masked until it has generated this many |
| `stop_token_ids` | token ids that end the request like EOS (the token is kept in the output) |
| `ignore_eos` | True: EOS does not end the request (it ends at `max_new_tokens`, a stop token or the cache's end) |
| `bad_words_ids` | token-id sequences never generated: a sequence's last token is masked where the output ends with the rest |

Order, as vLLM's sampler: bad words, min_tokens and logit_bias, then the penalties (repetition, frequency, presence),
all on the raw logits; then the generation config's processors and the request's temperature / top-k / top-p
(transformers' processors, cbcore/sampling.py); then min_p. min_p commutes with top-k / top-p (a token's
probability relative to the most likely one does not change when others are dropped), so its place after them
gives vLLM's result.

Where transformers differs: its `repetition_penalty` is the same; it has no frequency / presence penalty or
`min_p`-before-top-k; its `NoBadWordsLogitsProcessor` matches the whole history (prompt included) where vLLM and
cbcore match the output only; its `min_new_tokens` masks EOS only, where `min_tokens` also masks `stop_token_ids`.
A request's controls apply on top of whatever the manager's generation config sets (a config repetition penalty and a
request's one both apply, as two processors would).

The masks and penalties are built once per step for the rows that carry a control (token lists become one tensor
each, applied with one indexed write); rows without controls cost nothing.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

PENALTY_KWARGS = ("repetition_penalty", "frequency_penalty", "presence_penalty")
CONTROL_KWARGS = (*PENALTY_KWARGS, "logit_bias", "min_p", "min_tokens", "stop_token_ids", "ignore_eos",
                  "bad_words_ids")
# Every control's neutral value: a request carrying it is treated as not carrying the control at all.
NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": {},
           "min_p": 0.0, "min_tokens": 0, "stop_token_ids": [], "ignore_eos": False, "bad_words_ids": []}
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound


def _real(value: Any, name: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise TypeError(f"{what}: {name} must be a finite number, got {value!r} ({type(value).__name__})")
    return float(value)


def _token(value: Any, name: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise TypeError(f"{what}: {name} must hold token ids (ints >= 0), got {value!r} ({type(value).__name__})")
    return int(value)


def _tokens(value: Any, name: str, what: str) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{what}: {name} must be a list of token ids, got {value!r} ({type(value).__name__})")
    return [_token(token, name, what) for token in value]


def check_controls(kwargs: dict[str, Any], what: str) -> dict[str, Any]:
    """The controls among `kwargs`, checked and normalised (floats, ints, lists); a control at its neutral value is
    dropped, so a request that sends the defaults costs nothing in the sampler. TypeError / ValueError naming `what`
    and the control otherwise. Token ids are checked against the vocabulary by the engine (`token_problem`)."""
    controls: dict[str, Any] = {}
    for name in ("frequency_penalty", "presence_penalty"):
        if name in kwargs:
            value = _real(kwargs[name], name, what)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{what}: {name} must be in [-2, 2], got {value}")
            controls[name] = value
    if "repetition_penalty" in kwargs:
        value = _real(kwargs["repetition_penalty"], "repetition_penalty", what)
        if value <= 0:
            raise ValueError(f"{what}: repetition_penalty must be > 0 (1 turns it off), got {value}")
        controls["repetition_penalty"] = value
    if "min_p" in kwargs:
        value = _real(kwargs["min_p"], "min_p", what)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{what}: min_p must be in [0, 1], got {value}")
        controls["min_p"] = value
    if "min_tokens" in kwargs:
        value = kwargs["min_tokens"]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{what}: min_tokens must be an int >= 0, got {value!r}")
        controls["min_tokens"] = int(value)
    if "logit_bias" in kwargs:
        bias = kwargs["logit_bias"]
        if not isinstance(bias, dict):
            raise TypeError(f"{what}: logit_bias must be a dict {{token id: bias}}, got {type(bias).__name__}")
        checked = {}
        for token, value in bias.items():
            value = _real(value, f"logit_bias[{token!r}]", what)
            if abs(value) > MAX_LOGIT_BIAS:
                raise ValueError(f"{what}: logit_bias[{token!r}] must be in [-100, 100], got {value}")
            checked[_token(token, "logit_bias", what)] = value
        controls["logit_bias"] = checked
    if "stop_token_ids" in kwargs:
        controls["stop_token_ids"] = _tokens(kwargs["stop_token_ids"], "stop_token_ids", what)
    if "ignore_eos" in kwargs:
        if not isinstance(kwargs["ignore_eos"], bool):
            raise TypeError(f"{what}: ignore_eos must be True or False, got {kwargs['ignore_eos']!r}")
        controls["ignore_eos"] = kwargs["ignore_eos"]
    if "bad_words_ids" in kwargs:
        words = kwargs["bad_words_ids"]
        if isinstance(words, (str, bytes)) or not isinstance(words, (list, tuple)):
            raise TypeError(f"{what}: bad_words_ids must be a list of token-id lists, got {type(words).__name__}")
        checked_words = [_tokens(word, "bad_words_ids", what) for word in words]
        if any(not word for word in checked_words):
            raise ValueError(f"{what}: bad_words_ids must not hold an empty sequence")
        controls["bad_words_ids"] = checked_words
    return {name: value for name, value in controls.items() if value != NEUTRAL[name]}


def token_problem(controls: dict[str, Any], vocab_size: int) -> str | None:
    """A token id of a request's controls outside the vocabulary, named, or None."""
    named = [("stop_token_ids", controls.get("stop_token_ids", ())), ("logit_bias", controls.get("logit_bias", ()))]
    named += [("bad_words_ids", word) for word in controls.get("bad_words_ids", ())]
    for name, tokens in named:
        bad = next((t for t in tokens if t >= vocab_size), None)
        if bad is not None:
            return f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size})"
    return None


@dataclass
class ControlRow:
    """One emitting row's controls and what they read: its prompt and output tokens, its stop tokens."""

    row: int
    controls: dict[str, Any]
    prompt: Sequence[int]
    output: Sequence[int]
    stop_tokens: frozenset[int]  # what min_tokens masks: EOS (unless ignore_eos) and stop_token_ids


def _pairs_tensor(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.tensor(pairs, dtype=torch.long, device=device).view(-1, 2)
    return index[:, 0], index[:, 1]


def apply_before_processors(scores: torch.Tensor, rows: list[ControlRow]) -> torch.Tensor:
    """Bad words, min_tokens, logit_bias and the penalties on `scores` `[rows, vocab]` (float32, changed in place and
    returned), for the rows listed (the others are untouched)."""
    masked: list[tuple[int, int]] = []
    biased: list[tuple[int, int]] = []
    biases: list[float] = []
    penalised: list[ControlRow] = []
    for item in rows:
        controls = item.controls
        if len(item.output) < controls.get("min_tokens", 0):
            masked += [(item.row, token) for token in item.stop_tokens]
        for word in controls.get("bad_words_ids", ()):
            n = len(word) - 1  # the word's last token is banned where the output ends with its first n
            if n == 0 or (len(item.output) >= n and list(item.output[-n:]) == word[:-1]):
                masked.append((item.row, word[-1]))
        for token, bias in controls.get("logit_bias", {}).items():
            biased.append((item.row, token))
            biases.append(bias)
        if any(name in controls for name in PENALTY_KWARGS):
            penalised.append(item)
    if masked:
        scores.index_put_(_pairs_tensor(masked, scores.device), torch.tensor(-math.inf, device=scores.device))
    if biased:
        scores.index_put_(_pairs_tensor(biased, scores.device),
                          torch.tensor(biases, dtype=scores.dtype, device=scores.device), accumulate=True)
    if penalised:
        _apply_penalties(scores, penalised)
    return scores


def _padded(sequences: list[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`[len(sequences), longest]` token ids (padding 0) and the mask of the real entries."""
    width = max((len(s) for s in sequences), default=0)
    ids = torch.tensor([list(s) + [0] * (width - len(s)) for s in sequences], dtype=torch.long,
                       device=device).view(len(sequences), width)
    lengths = torch.tensor([len(s) for s in sequences], device=device)
    return ids, torch.arange(width, device=device).view(1, -1) < lengths.view(-1, 1)


def _apply_penalties(scores: torch.Tensor, rows: list[ControlRow]) -> None:
    """Repetition (prompt and output), frequency and presence (output) penalties of `rows`, as vLLM applies them."""
    device, vocab = scores.device, scores.shape[1]
    index = torch.tensor([item.row for item in rows], dtype=torch.long, device=device)
    sub = scores.index_select(0, index)

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([item.controls.get(name, NEUTRAL[name]) for item in rows], dtype=scores.dtype,
                            device=device).view(-1, 1)

    output_ids, output_real = _padded([item.output for item in rows], device)
    counts = torch.zeros(len(rows), vocab, dtype=scores.dtype, device=device)
    counts.scatter_add_(1, output_ids, output_real.to(scores.dtype))
    in_output = counts > 0
    if any("repetition_penalty" in item.controls for item in rows):
        prompt_ids, prompt_real = _padded([item.prompt for item in rows], device)
        in_prompt = torch.zeros(len(rows), vocab, dtype=scores.dtype, device=device)
        in_prompt.scatter_add_(1, prompt_ids, prompt_real.to(scores.dtype))  # padding adds 0
        seen = (in_prompt > 0) | in_output
        penalty = per_row("repetition_penalty").expand_as(sub)
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    sub = sub - per_row("frequency_penalty") * counts - per_row("presence_penalty") * in_output.to(scores.dtype)
    scores.index_copy_(0, index, sub)


def apply_min_p(scores: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop (set to -inf) each row's tokens whose probability is below `min_p[row]` times its most likely token's;
    `scores` are the processed logits (temperature applied). Returns new scores."""
    threshold = torch.tensor(min_p, dtype=scores.dtype, device=scores.device).view(-1, 1)
    probs = torch.softmax(scores, dim=-1)
    drop = probs < threshold * probs.amax(dim=-1, keepdim=True)
    return scores.masked_fill(drop, -math.inf)
