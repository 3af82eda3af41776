"""The grammar engine behind structured output (cbcore/structured_output.py): xgrammar, from PyPI.

`GrammarEngine`: xgrammar set up for one tokenizer and vocabulary (built once per tokenizer, vocabulary size and
end-of-sequence ids, and shared by every manager using them), which compiles a request's constraint into a grammar,
once per distinct constraint (xgrammar's compiler cache, bounded by `GRAMMAR_CACHE_BYTES`). `RequestGrammar`: one
request's matcher, which says which tokens may come next (a row of the step's token bitmask) and advances on each
generated token. `step_bitmask` fills the bitmask of a step's constrained rows, `apply_bitmask` sets their disallowed
logits to -inf before anything else of sampling sees them (vLLM's order: the logprobs a constrained request reports
are of the masked distribution).

xgrammar rather than llguidance: it fills a row's mask about ten times faster, what every constrained row pays every
step (bench/results/grammar_engines.md). Its import takes seconds, so it is imported only when a request first asks
for structured output.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import weakref
from typing import Any

import torch

from .structured_output import StructuredOutput

# The most memory xgrammar's compiler keeps compiled grammars in, per tokenizer (least recently used dropped).
GRAMMAR_CACHE_BYTES = 256 * 2**20
# xgrammar's errors start with a log prefix ("[12:00:00] /project/cpp/file.cc:82: "): what follows is the message.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A constraint that does not compile (a malformed schema, regex or grammar); the message says why."""


class GrammarEngine:
    """xgrammar for one tokenizer: compiles constraints (each distinct one once) and makes request matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        """`vocab_size`: the logits' width (the model's, which may pad the tokenizer's: the padding is never allowed);
        `stop_token_ids`: the tokens that end a generation (a complete grammar allows only these)."""
        import xgrammar

        self.xgrammar = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids) or None)
        # One thread: compiling runs on the caller's thread of add_request, beside the loop's step (which keeps
        # the cores busy); a grammar compiles in milliseconds.
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                                 cache_limit_bytes=GRAMMAR_CACHE_BYTES)

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar of `constraint` (cached by xgrammar per distinct one); `GrammarError` when it does
        not compile."""
        kind = constraint.kind
        try:
            if kind == "json":
                schema = constraint.json
                return self.compiler.compile_json_schema(
                    schema if isinstance(schema, str) else json.dumps(schema),
                    any_whitespace=not constraint.disable_any_whitespace,
                    separators=(",", ":") if constraint.disable_any_whitespace else None)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}',
                                                         any_whitespace=not constraint.disable_any_whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(constraint.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(constraint.choice))
            if kind == "grammar":
                return self.compiler.compile_grammar(constraint.grammar)
            tag = constraint.structural_tag
            return self.compiler.compile_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
        except (RuntimeError, ValueError, TypeError) as error:
            message = _LOG_PREFIX.sub("", str(error).strip()) or type(error).__name__
            raise GrammarError(f"structured_output.{kind} does not compile: {message}") from None

    def request_grammar(self, constraint: StructuredOutput, stop_token_ids: frozenset[int]) -> RequestGrammar:
        """A fresh matcher for one request; `stop_token_ids`: the request's own ending tokens."""
        return RequestGrammar(self, self.compile(constraint), stop_token_ids)


class RequestGrammar:
    """One request's place in its grammar: which tokens may come next, advanced by each generated token. A host
    object on the request: it follows the request through preemption (swap or recompute keep its generated tokens,
    so its place is unchanged) and is rebuilt for each `num_return_sequences` child."""

    def __init__(self, engine: GrammarEngine, compiled: Any, stop_token_ids: frozenset[int]) -> None:
        self.engine = engine
        self.compiled = compiled
        self.stop_token_ids = stop_token_ids
        # With no ending token (ignore_eos and no stop ids) the matcher ends where the grammar does.
        self.matcher = engine.xgrammar.GrammarMatcher(
            compiled, override_stop_tokens=sorted(stop_token_ids) or None,
            terminate_without_stop_token=not stop_token_ids)

    def fork(self, generated_tokens: list[int]) -> RequestGrammar:
        """A matcher for a child that has generated `generated_tokens` (none, when forked at its parent's prompt)."""
        child = RequestGrammar(self.engine, self.compiled, self.stop_token_ids)
        for token in generated_tokens:
            child.accept(token)
        return child

    def accept(self, token: int) -> bool:
        """Advance on a generated token; False when the grammar does not allow it (it is then not advanced)."""
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """Whether the text is complete (an ending token was accepted, or the grammar ended without one)."""
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (int32, one bit per token)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


def step_bitmask(rows: int, grammars: list[tuple[int, RequestGrammar]]) -> torch.Tensor:
    """The token bitmask `[rows, ceil(vocab / 32)]` of a step's emitting rows, filled for the constrained ones
    (`(row, grammar)` pairs; the other rows are left allowing everything and are not applied)."""
    engine = grammars[0][1].engine
    bitmask = engine.xgrammar.allocate_token_bitmask(rows, engine.vocab_size)
    for row, grammar in grammars:
        grammar.fill(bitmask, row)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the disallowed logits of `rows` to -inf, in place (`logits` `[rows, vocab]`, any float dtype): on the
    CPU by `cbcore._C.apply_token_bitmask` (fp32 / bf16 rows; a word of 32 allowed tokens skipped, a word of none
    one fill: ~30x xgrammar's bit-by-bit kernel where the grammar allows few tokens), else by xgrammar's kernels
    (CUDA, Triton). On a GPU the mask is filled while the forward still runs there: nothing between launching the
    forward and this point waits for the device."""
    kernel = _bitmask_kernel()
    if (kernel is not None and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.stride(1) == 1):
        kernel(logits, bitmask, rows)
        return
    import xgrammar

    if logits.device != bitmask.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def reference_apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The plain-torch reference of `apply_bitmask`: bit t of a row's bitmask is token t allowed."""
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    for row in rows:
        allowed = ((bitmask[row].unsqueeze(-1) >> shifts) & 1).bool().flatten()[:vocab]
        logits[row, :vocab].masked_fill_(~allowed.to(logits.device), float("-inf"))


@functools.cache
def _bitmask_kernel():
    try:
        from . import _C
    except ImportError:
        return None
    return getattr(_C, "apply_token_bitmask", None)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose text is exactly one of `choices` (each a JSON-escaped string literal, which xgrammar's
    EBNF reads with the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


# tokenizer -> {(vocab size, stop ids): engine}; a tokenizer that is dropped takes its engines with it.
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENGINES_LOCK = threading.Lock()


def engine_for(tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarEngine:
    """The grammar engine of this tokenizer, vocabulary size and ending tokens (built once: preparing a tokenizer's
    vocabulary takes ~0.2 s for SmolLM2's 49k tokens)."""
    with _ENGINES_LOCK:
        engines = _ENGINES.setdefault(tokenizer, {})
        key = (vocab_size, tuple(sorted(stop_token_ids)))
        engine = engines.get(key)
        if engine is None:
            engine = engines[key] = GrammarEngine(tokenizer, vocab_size, key[1])
        return engine
