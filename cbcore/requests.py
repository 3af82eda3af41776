"""Requests: the public `GenerationOutput` / `RequestStatus` and the engine's per-request `RequestState`.

`GenerationOutput` and `RequestStatus` mirror transformers 5.24 (`transformers.generation.continuous_batching.requests`)
field for field and value for value. cbcore adds one status, `CANCELLED = 5`: transformers emits nothing for a
cancelled request, so a streaming reader waits forever (the README's "Differences from transformers").

`RequestState` is the engine's view of one request. Its token bookkeeping is deliberately simple (nano-vllm style):
`all_tokens` is the prompt followed by every generated token, and `num_computed_tokens` says how many of them already
have their K/V in the cache. A prefill chunk, a prefix-cache hit, a decode step and a recompute after preemption are
then the same thing: move `num_computed_tokens` forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch

from .sampling import SEED_KWARG


class RequestStatus(IntEnum):
    """Status of a request through its lifecycle: transformers' values 0-4, plus `CANCELLED`."""

    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5  # cbcore only: a cancelled request still gets one terminal output


@dataclass
class GenerationOutput:
    """What a caller receives for a request: a snapshot (streaming) or the final result.

    Same fields as transformers' `GenerationOutput`:
        request_id: the request's id.
        prompt_ids: the prompt's token ids.
        generated_tokens: the tokens generated so far (all of them once the request is finished).
        logprobs: log-probabilities of the generated tokens, when `return_logprobs` is on.
        error: why the request failed, or None.
        status: a `RequestStatus`.
        created_time: `time.perf_counter()` when the request was created.
        lifespan: (time the request left PENDING, time it ended), -1 where not reached.
        timestamps: one `perf_counter()` stamp per generated token when `record_timestamps` was asked, else None.
    cbcore's addition:
        top_logprobs: for a request with the per-request kwarg `top_logprobs=n`, per generated token the (token ids,
            logprobs) of the model's n most likely tokens (raw logits; see cbcore/sampling.py); else empty.
        logprob_mass: with `logprobs_mode="processed"`, per generated token the log of the probability mass its
            truncating sampler (top-k, top-p, min_p) kept; else empty.
        prompt_logprobs: with `prompt_logprobs=k`, the prompt's logprobs once its prefill is done (`PromptLogprobs`);
            else None.
    """

    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None
    status: RequestStatus = RequestStatus.PENDING
    created_time: float = field(default_factory=time.perf_counter)
    lifespan: tuple[float, float] = (-1, -1)
    timestamps: list[float] | None = None
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    logprob_mass: list[float] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None

    def is_finished(self) -> bool:
        """Whether the request reached a terminal state (finished, failed or cancelled)."""
        return self.status >= RequestStatus.FINISHED


@dataclass
class PromptLogprobs:
    """The log-probabilities of a prompt's tokens under the model, as vLLM's `prompt_logprobs` gives them: entry i
    is about prompt token i given the tokens before it; the first token has none (None)."""

    token_logprobs: list[float | None]
    # Per position, the (token ids, logprobs) of the k most likely tokens there; None for the first position.
    top_logprobs: list[tuple[list[int], list[float]] | None]


def child_request_id(parent_id: str, index: int) -> str:
    """The id of a parent's `index`-th child for `num_return_sequences`, as transformers names it."""
    return f"{parent_id}__child#{index}"


def split_child_id(request_id: str) -> tuple[str | None, int]:
    """("req_3", 1) for "req_3__child#1"; (None, -1) for an id that is not a child's."""
    parent, sep, index = request_id.rpartition("__child#")
    if not sep or not index.isdigit():
        return None, -1
    return parent, int(index)


# Stand-in for "no limit" so that the hot path compares ints instead of checking for None (as transformers does).
NO_TOKEN_LIMIT = 2**31 - 1


@dataclass(eq=False)
class RequestState:
    """The engine's state of one request. Owned by the manager's loop thread; never touched by other threads.

    Public fields follow transformers' `RequestState` where they mean the same thing (`request_id`,
    `initial_tokens`, `max_new_tokens`, `eos_token_id`, `streaming`, `record_timestamps`, `generated_tokens`,
    `logprobs`, `error`, `created_time`, `lifespan`, `num_children`, `logit_processor_kwargs`).
    """

    request_id: str
    initial_tokens: list[int]
    max_new_tokens: int | None = 20
    eos_token_id: int | list[int] | None = None
    streaming: bool = False
    record_timestamps: bool = False
    num_children: int = 0
    logit_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    # Its sampling controls (penalties, logit_bias, min_p, min_tokens, stop_token_ids, ignore_eos, bad words),
    # checked and without neutral values (cbcore/sampling_controls.py); empty for most requests.
    sampling_controls: dict[str, Any] = field(default_factory=dict)
    # prompt_logprobs=k: the logprob of every prompt token after the first, and its k most likely alternatives.
    prompt_logprobs: int | None = None

    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    logprob_mass: list[float] = field(default_factory=list)
    # With prompt_logprobs: per prompt position computed so far, the logprob of its token (None for the first) and
    # the (token ids, logprobs) of the most likely tokens there (None for the first).
    prompt_token_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[tuple[list[int], list[float]] | None] = field(default_factory=list)
    error: str | None = None
    created_time: float = field(default_factory=time.perf_counter)
    lifespan: tuple[float, float] = (-1, -1)
    _status: RequestStatus = RequestStatus.PENDING
    _timestamps: list[float] = field(default_factory=list)
    _prompt_logprobs_done: PromptLogprobs | None = field(default=None, repr=False)

    # --- engine bookkeeping (see the module docstring) ---
    # Prompt followed by the generated tokens; the model consumes these.
    all_tokens: list[int] = field(default_factory=list)
    # How many tokens of `all_tokens` have their K/V written in the cache.
    num_computed_tokens: int = 0
    # Physical block ids holding this request's K/V, in token order; token t lives in block_table[t // page_size].
    block_table: list[int] = field(default_factory=list)
    # Its row of the state pool, for a model with stateful layers (cbcore/state_slots.py); None without one.
    state_slot: int | None = None
    # Slots reserved at admission for the children a `num_return_sequences` parent will fork.
    child_state_slots: list[int] = field(default_factory=list)
    # While swapped out: the host blocks holding its first `num_computed_tokens` tokens' K/V (block_table is empty).
    host_blocks: list[int] = field(default_factory=list)
    # How many leading blocks of `block_table` have been offered to the prefix cache (full blocks only).
    num_committed_blocks: int = 0
    # Prompt tokens that came from the prefix cache at the last admission (not recomputed).
    num_prefix_hit_tokens: int = 0
    # How many times this request was preempted (its blocks freed and its tokens recomputed later), and how many
    # tokens it had generated at the last preemption (until it generates more, it is not preempted again).
    num_preemptions: int = 0
    generated_at_last_preemption: int = 0
    # The most tokens this request ever had computed: anything computed again below this mark is recomputation.
    max_computed_tokens: int = 0
    # Set of EOS ids (transformers ignores negative ids).
    eos_token_ids: frozenset[int] = frozenset()
    # The ids that end the request when generated: EOS (unless the ignore_eos control) and the stop_token_ids control.
    finish_token_ids: frozenset[int] = frozenset()
    new_tokens_limit: int = NO_TOKEN_LIMIT
    # Set by `cancel_request` (under the manager's request lock) while the request is queued and not yet taken in.
    cancel_requested: bool = False
    # Indices of children (num_return_sequences) cancelled before their fork: they are never forked.
    cancelled_children: set[int] = field(default_factory=set)
    # The request's own torch.Generator when it has a `seed` (made with the request; it keeps its state across steps,
    # preemption and recompute included: tokens already drawn are never drawn again).
    sampling_generator: Any = field(default=None, repr=False)
    # With structured_output: its grammar matcher (cbcore/grammar.py `RequestGrammar`), advanced by each generated
    # token; or why its constraint does not compile (the request then ends FAILED with that message).
    grammar: Any = field(default=None, repr=False)
    grammar_problem: str | None = None

    def __post_init__(self) -> None:
        self.all_tokens = list(self.initial_tokens)
        self.new_tokens_limit = NO_TOKEN_LIMIT if self.max_new_tokens is None else self.max_new_tokens
        if self.eos_token_id is None:
            eos: list[int] = []
        elif isinstance(self.eos_token_id, int):
            eos = [self.eos_token_id]
        else:
            eos = list(self.eos_token_id)
        self.eos_token_ids = frozenset(t for t in eos if t >= 0)
        controls = self.sampling_controls
        self.finish_token_ids = frozenset(controls.get("stop_token_ids", ())).union(
            () if controls.get("ignore_eos", False) else self.eos_token_ids)
        seed = self.logit_processor_kwargs.get(SEED_KWARG)
        if seed is not None and self.sampling_generator is None:
            self.sampling_generator = torch.Generator().manual_seed(seed)
        if self.prompt_logprobs is not None and not self.prompt_token_logprobs:
            self.prompt_token_logprobs, self.prompt_top_logprobs = [None], [None]  # the first token has none

    @property
    def status(self) -> RequestStatus:
        """The request's status; leaving PENDING and reaching a terminal state stamp `lifespan`."""
        return self._status

    @status.setter
    def status(self, value: RequestStatus) -> None:
        now = time.perf_counter()
        if self._status == RequestStatus.PENDING and value != RequestStatus.PENDING:
            self.lifespan = (now, -1)
        if value >= RequestStatus.FINISHED:
            self.lifespan = (self.lifespan[0], now)
        self._status = value

    @property
    def timestamps(self) -> list[float] | None:
        """Per-token timestamps when `record_timestamps` was asked, else None."""
        return self._timestamps if self.record_timestamps else None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_tokens)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V is not in the cache yet: the rest of the prompt, or the last generated token."""
        return len(self.all_tokens) - self.num_computed_tokens

    @property
    def next_prompt_row(self) -> int | None:
        """With `prompt_logprobs`: the first prompt position whose row's logits are still needed (entry i comes from
        the row at position i - 1); None when none is (not asked, or every entry computed)."""
        if self.prompt_logprobs is None or len(self.prompt_token_logprobs) >= len(self.initial_tokens):
            return None
        return len(self.prompt_token_logprobs) - 1

    def add_prompt_logprobs(self, start: int, logprobs: list[float],
                            tops: list[tuple[list[int], list[float]]]) -> None:
        """Record the entries of prompt positions `start + 1` on (scored by the rows from `start`); entries already
        held (a recomputed prefix) are kept."""
        skip = len(self.prompt_token_logprobs) - (start + 1)
        if skip < 0:
            raise RuntimeError(f"request {self.request_id}: prompt logprobs from position {start + 1} but only "
                               f"{len(self.prompt_token_logprobs)} computed")
        self.prompt_token_logprobs.extend(logprobs[skip:])
        self.prompt_top_logprobs.extend(tops[skip:])

    @property
    def is_finished(self) -> bool:
        """Whether the request reached a terminal status."""
        return self._status >= RequestStatus.FINISHED

    def append_token(self, token_id: int, logprob: float | None,
                     top_logprobs: tuple[list[int], list[float]] | None = None, mass: float | None = None) -> bool:
        """Record a generated token (with its logprob, its step's most likely alternatives and the log of the mass
        its truncating sampler kept, when computed); return True when the request is now complete (EOS, a stop token
        or max_new_tokens)."""
        if self.record_timestamps:
            self._timestamps.append(time.perf_counter())
        self.generated_tokens.append(token_id)
        self.all_tokens.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        if top_logprobs is not None:
            self.top_logprobs.append(top_logprobs)
        if mass is not None:
            self.logprob_mass.append(mass)
        return token_id in self.finish_token_ids or len(self.generated_tokens) >= self.new_tokens_limit

    def fork_child(self, request_id: str) -> RequestState:
        """A child for `num_return_sequences`: same prompt, settings and progress, no blocks (the cache shares them),
        its own id and creation time. Mirrors transformers' `RequestState.fork`. A seeded request's child `i` draws
        from its own generator, seeded `seed + 1 + i` (as vLLM seeds a request's samples `seed + index`): with one
        seed for all, every sample of the request would be the same."""
        kwargs = dict(self.logit_processor_kwargs)
        _, index = split_child_id(request_id)
        if kwargs.get(SEED_KWARG) is not None and index >= 0:
            kwargs[SEED_KWARG] = (kwargs[SEED_KWARG] + 1 + index) % 2**63
        child = RequestState(
            request_id=request_id,
            initial_tokens=self.initial_tokens,
            max_new_tokens=self.max_new_tokens,
            eos_token_id=self.eos_token_id,
            streaming=self.streaming,
            record_timestamps=self.record_timestamps,
            logit_processor_kwargs=kwargs,
            sampling_controls=self.sampling_controls,
            prompt_logprobs=self.prompt_logprobs,
        )
        child.all_tokens = list(self.all_tokens)
        child.generated_tokens = list(self.generated_tokens)
        child.logprobs = list(self.logprobs)
        child.top_logprobs = list(self.top_logprobs)
        child.logprob_mass = list(self.logprob_mass)
        child.prompt_token_logprobs = list(self.prompt_token_logprobs)
        child.prompt_top_logprobs = list(self.prompt_top_logprobs)
        if self.grammar is not None:
            child.grammar = self.grammar.fork(child.generated_tokens)
        child._status = self._status
        child.lifespan = (child.created_time, -1)
        return child

    def _prompt_logprobs_output(self) -> PromptLogprobs | None:
        """The prompt logprobs once every prompt position has them, else None."""
        if self.prompt_logprobs is None or len(self.prompt_token_logprobs) < len(self.initial_tokens):
            return None
        if self._prompt_logprobs_done is None:  # built once: every later snapshot shares it (never changed again)
            self._prompt_logprobs_done = PromptLogprobs(self.prompt_token_logprobs, self.prompt_top_logprobs)
        return self._prompt_logprobs_done

    def to_generation_output(self) -> GenerationOutput:
        """A snapshot for the caller; lists are copied so later steps never change what was delivered."""
        return GenerationOutput(
            request_id=self.request_id,
            prompt_ids=list(self.initial_tokens),
            generated_tokens=list(self.generated_tokens),
            logprobs=list(self.logprobs),
            top_logprobs=list(self.top_logprobs),
            logprob_mass=list(self.logprob_mass),
            prompt_logprobs=self._prompt_logprobs_output(),
            error=self.error,
            status=self._status,
            created_time=self.created_time,
            lifespan=self.lifespan,
            timestamps=list(self._timestamps) if self.record_timestamps else None,
        )
