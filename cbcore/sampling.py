"""Turning the logits of the rows that emit a token into tokens (and log-probabilities).

Logits processors come from the model's own `_get_logits_processor(generation_config, input_ids_seq_length)`,
exactly what `model.generate` builds for a prompt of that length (processors such as min_new_tokens count from the
prompt's end, so they are built per prompt length and cached). They are applied row by row with that request's own
history (prompt + generated tokens) as `input_ids`, so history-aware processors (repetition penalty, no-repeat n-gram,
...) see the real history rather than a batch-shaped stand-in. With no processors (plain greedy, the common case) no
per-row work is done at all.

With `per_request_processors`, a request may carry its own `temperature`, `top_k` and `top_p` (transformers' three
per-request kwargs, same types); its processors are then built from the generation config with those values.

Log-probabilities: with `return_logprobs`, each chosen token's log-probability under the distribution it was drawn
from (the processed scores), as transformers reports them. A request carrying `top_logprobs=n` (cbcore's per-request
kwarg, what the OpenAI server sends) gets the model's own log-probabilities instead, as vLLM's default
(`raw_logprobs`) and OpenAI report them: of the raw logits, before any processor, temperature or top-k/top-p, for the
chosen token and for the n most likely tokens of each step (n = 0: the chosen token's only). With
`logprobs_mode="processed"` they are those of the distribution the token was drawn from (after the sampling controls,
the processors, temperature, top-k / top-p and min_p), and `logprob_mass` adds the log of the probability mass the
truncation kept, measured before the first truncating warper: what an RL trainer needs to weigh a sample taken from a
truncated distribution.

A request's sampling controls (penalties, logit_bias, min_p, min_tokens, stop tokens, bad words) are applied to all
the rows carrying them at once (cbcore/sampling_controls.py): before the processors, and min_p after them.

A request with structured output has its disallowed tokens set to -inf first of all (cbcore/grammar.py), so every
later stage, the logprobs included, sees the constrained distribution (vLLM's order).
"""

from __future__ import annotations

import functools
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .grammar import RequestGrammar, apply_bitmask, step_bitmask
from .sampling_controls import ControlRow, apply_before_processors, apply_min_p

# (prompt_length, max_new_tokens, per-request overrides) -> the processors model.generate would use for that call.
ProcessorFactory = Callable[[int, "int | None", dict], LogitsProcessorList]

# transformers' per-request kwargs and their types (cb_logits_processors.py), and the ones it accepts and ignores.
PER_REQUEST_KWARGS: dict[str, type] = {"temperature": float, "top_k": int, "top_p": float}
IGNORED_KWARGS = ("filter_value", "min_tokens_to_keep")
# A request's own seed (cbcore's addition, as vLLM's `seed`): its tokens are drawn from a generator of its own, so
# they are the same whatever else shares its steps. Not a processor setting.
SEED_KWARG = "seed"
# A request's own count of alternatives (cbcore's addition, the OpenAI server's `top_logprobs`): the model's raw
# log-probabilities of its chosen tokens and of this many most likely tokens at each step. Not a processor setting.
TOP_LOGPROBS_KWARG = "top_logprobs"
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
# A request's choice of logprobs (cbcore's addition, vLLM's `logprobs_mode`): "raw" (the default, the model's own) or
# "processed" (of the distribution its token was drawn from, after penalties, temperature and truncation, with the
# log of the probability mass the truncation kept, `GenerationOutput.logprob_mass`).
LOGPROBS_MODE_KWARG = "logprobs_mode"
LOGPROBS_MODES = ("raw", "processed")
# The warpers that drop tokens (the kept mass is measured before the first of them).
TRUNCATING_WARPERS = (TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper, EpsilonLogitsWarper,
                      EtaLogitsWarper, TopHLogitsWarper)
# A request's scheduling priority (cbcore's addition, vLLM's `priority`): lower is served first; read by the scheduler,
# not by any processor.
PRIORITY_KWARG = "priority"
# How many processor lists (one per prompt length, token limit and per-request values) the sampler keeps built.
MAX_CACHED_PROCESSOR_LISTS = 1024


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """`scores.argmax(dim=-1)` on the CPU: the first maximum of each row (a NaN counts as the maximum), by
    `cbcore._C.greedy_tokens` where it is built (contiguous float32 or bfloat16 rows, AVX2 or AVX-512: torch's CPU
    argmax carries an index through a scalar reduction, an order of magnitude slower on a decode step's rows), else
    torch's."""
    kernel = _greedy_kernel()
    if kernel is not None and scores.device.type == "cpu" and scores.dim() == 2 and scores.shape[1] > 0:
        return kernel(scores)
    return scores.argmax(dim=-1)


@functools.cache
def _greedy_kernel() -> Callable[[torch.Tensor], torch.Tensor] | None:
    try:
        from . import _C
    except ImportError:
        return None
    return getattr(_C, "greedy_tokens", None)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` `[rows, vocab]` (rows summing to 1), by inverse-CDF sampling: a uniform draw per
    row against the row's cumulative distribution. The distribution of `torch.multinomial(probs, 1)` up to fp32
    rounding, in one pass over the vocabulary: on this project's 2-core machine multinomial's CPU kernel takes
    45-48 ms for 64 rows of a 49k vocabulary (0.7-1.0 ms for one row), this 1.2-1.6 ms (0.05 ms);
    bench/sampling_draw.py."""
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=cdf.dtype) * total
    # Strictly below the total, so the token found has a positive probability even when u rounds up to it.
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


@dataclass
class Sampled:
    """What the sampler picked for a step's rows: a token per row, and what was asked about it."""

    tokens: list[int]
    # Per row, the chosen token's logprob (with `return_logprobs`, or a row's `top_logprobs`); None when not computed.
    logprobs: list[float] | None = None
    # Per row, (token ids, logprobs) of its `top_logprobs` most likely tokens; None when no row asked.
    top_logprobs: list[tuple[list[int], list[float]] | None] | None = None
    # Per row, the log of the probability mass the truncation kept (rows with logprobs_mode="processed").
    logprob_mass: list[float | None] | None = None


class LogitsProcessorSwitch:
    """`manager.logit_processor`, the part of transformers' `ContinuousBatchingLogitsProcessorList` that code driving
    a manager reads: `logits_processor` (what `model.generate` builds for this generation config, for a one-token
    prompt: the per-request lists are built from the same config), `do_processing`, `supported_keys` /
    `ignored_keys` (the per-request kwargs `add_request` takes, with their types, and those it accepts and ignores:
    transformers 5.25's serving layer keeps only the supported ones, cast to their types) and `clear()`, which turns
    every processor off so the sampler sees the raw logits (transformers' tests use it to compare logprobs)."""

    def __init__(self, logits_processor: LogitsProcessorList, per_request: bool = False) -> None:
        """`per_request`: whether requests may set their own temperature / top_k / top_p (per_request_processors
        with a sampling config; `request_inputs.processor_kwargs` refuses them otherwise)."""
        self.logits_processor = logits_processor
        self.do_processing = len(logits_processor) > 0
        self.supported_keys: dict[str, type] = dict(PER_REQUEST_KWARGS) if per_request else {}
        self.ignored_keys: set[str] = set(IGNORED_KWARGS) if per_request else set()
        # Set by clear() only: a config without processors still applies each request's own temperature / top_k /
        # top_p (per_request_processors), so "no base processor" must not switch those off.
        self.cleared = False

    def clear(self) -> None:
        """No processor runs from the next step on."""
        self.logits_processor = LogitsProcessorList()
        self.do_processing = False
        self.supported_keys = {}
        self.ignored_keys = set()
        self.cleared = True


class Sampler:
    """Greedy or multinomial sampling over processed logits, reproducible with a seed."""

    def __init__(
        self,
        generation_config: GenerationConfig,
        processor_factory: ProcessorFactory,
        return_logprobs: bool = False,
        seed: int | None = None,
        per_request_processors: bool = False,
        switch: LogitsProcessorSwitch | None = None,
        do_sample: bool | None = None,
    ) -> None:
        """`processor_factory(prompt_length, max_new_tokens, overrides)` builds the processors `model.generate` would
        use for that prompt and length. Per-request kwargs are checked by `request_inputs.processor_kwargs` when the
        request is added."""
        self.do_sample = bool(generation_config.do_sample if do_sample is None else do_sample)
        self.return_logprobs = return_logprobs
        self.per_request_processors = per_request_processors
        self._processor_factory = processor_factory
        # (prompt length, max_new_tokens, overrides) -> processors, least recently used first; bounded, so a
        # long-running server with ever new prompt lengths does not grow it forever.
        self._processors: OrderedDict[tuple, LogitsProcessorList] = OrderedDict()
        self.has_processors = len(processor_factory(1, None, {})) > 0
        self.switch = switch if switch is not None else LogitsProcessorSwitch(processor_factory(1, None, {}))
        # Structured output's cost: the steps with constrained rows, and the time filling and applying their masks.
        self.masked_steps = 0
        self.mask_seconds = 0.0
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def processors_for(self, prompt_length: int, max_new_tokens: int | None, kwargs: dict) -> LogitsProcessorList:
        """The processors for a prompt of this length, this many new tokens (length-dependent processors such as a
        forced EOS count from it) and these per-request values; built once per combination."""
        overrides = {k: v for k, v in kwargs.items() if k in PER_REQUEST_KWARGS}
        key = (prompt_length, max_new_tokens, tuple(sorted(overrides.items())))
        processors = self._processors.get(key)
        if processors is None:
            processors = self._processor_factory(prompt_length, max_new_tokens, overrides)
            self._processors[key] = processors
            if len(self._processors) > MAX_CACHED_PROCESSOR_LISTS:
                self._processors.popitem(last=False)
        else:
            self._processors.move_to_end(key)
        return processors

    def sample(
        self,
        logits: torch.Tensor,
        histories: list[list[int]],
        prompt_lengths: list[int],
        request_kwargs: list[dict] | None = None,
        max_new_tokens: list[int | None] | None = None,
        generators: list[torch.Generator | None] | None = None,
        controls: list[ControlRow] | None = None,
        grammars: list[tuple[int, RequestGrammar]] | None = None,
    ) -> Sampled:
        """Pick one token per row of `logits` `[rows, vocab]`; `histories[i]` is row i's prompt + generated tokens,
        `prompt_lengths[i]` its prompt's length, `request_kwargs[i]` its per-request kwargs, `max_new_tokens[i]` its
        token limit and `generators[i]` its own generator (a request with a `seed`), or None for the sampler's shared
        one; `controls`: the rows carrying sampling controls (cbcore/sampling_controls.py); `grammars`: the rows
        with structured output and their matchers, whose disallowed tokens are masked out before anything else."""
        kwargs_per_row = request_kwargs or [{}] * len(histories)
        limits = max_new_tokens or [None] * len(histories)
        processing = not self.switch.cleared and (
            self.has_processors or any(not PER_REQUEST_KWARGS.keys().isdisjoint(k) for k in kwargs_per_row))
        asking = [row for row, kwargs in enumerate(kwargs_per_row) if TOP_LOGPROBS_KWARG in kwargs]
        processed = {row for row, kwargs in enumerate(kwargs_per_row)
                     if kwargs.get(LOGPROBS_MODE_KWARG) == "processed"}
        min_p = [item for item in controls or () if "min_p" in item.controls]
        # Greedy alone picks the same token from a bf16/fp16 row as from its fp32 widening (exact): no fp32 copy.
        plain_greedy = not (processing or self.do_sample or self.return_logprobs or asking or controls or grammars)
        raw = logits if plain_greedy else logits.float()
        if grammars:
            started = time.perf_counter()
            # In place: `raw` is the runner's fp32 logits of the emitting rows (or their fp32 copy), used once.
            apply_bitmask(raw, step_bitmask(raw.shape[0], grammars), [row for row, _ in grammars])
            self.mask_seconds += time.perf_counter() - started
            self.masked_steps += 1
        scores = apply_before_processors(raw.clone(), controls) if controls else raw
        truncated = scores  # before any truncating warper: the distribution whose kept mass is reported
        if processing:
            scores, truncated = self._process(scores, histories, prompt_lengths, kwargs_per_row, limits, processed)
        if min_p:
            thresholds = [0.0] * len(histories)
            for item in min_p:
                thresholds[item.row] = item.controls["min_p"]
            scores = apply_min_p(scores, thresholds)
        if self.do_sample:
            probs = torch.softmax(scores, dim=-1).cpu()
            tokens = draw(probs, self.generator)
            for row, generator in enumerate(generators or ()):
                if generator is not None:  # drawn from its own generator: the same whatever shares the step
                    tokens[row] = draw(probs[row : row + 1], generator)[0]
        else:
            tokens = greedy_tokens(scores).cpu()
        logprobs = None
        if self.return_logprobs:
            log_softmax = torch.log_softmax(scores, dim=-1).cpu()
            logprobs = log_softmax.gather(1, tokens.view(-1, 1)).squeeze(1).tolist()
        top = None
        if asking:
            top, chosen = self._top_logprobs(raw, scores, tokens, asking, kwargs_per_row, processed)
            if logprobs is not None:
                for row, logprob in chosen.items():
                    logprobs[row] = logprob
        mass = self._kept_mass(truncated, scores, processed) if processed else None
        return Sampled(tokens.tolist(), logprobs, top, mass)

    def _process(self, scores: torch.Tensor, histories: list[list[int]], prompt_lengths: list[int],
                 kwargs_per_row: list[dict], limits: list[int | None], processed: set[int]):
        """The processors of each row applied with its own history; for the rows in `processed`, also the scores
        before the first truncating warper (top-k, top-p, ...). Returns (scores, scores before truncation)."""
        rows, before = [], []
        for row, (history, prompt_length, kwargs) in enumerate(zip(histories, prompt_lengths, kwargs_per_row)):
            processors = self.processors_for(prompt_length, limits[row], kwargs)
            current = scores[row : row + 1]
            if len(processors):
                input_ids = torch.tensor([history], dtype=torch.long, device=scores.device)
                if row in processed:
                    cut = next((i for i, p in enumerate(processors) if isinstance(p, TRUNCATING_WARPERS)),
                               len(processors))
                    current = LogitsProcessorList(processors[:cut])(input_ids, current)
                    before.append(current)
                    current = LogitsProcessorList(processors[cut:])(input_ids, current)
                else:
                    current = processors(input_ids, current)
                    before.append(current)
            else:
                before.append(current)
            rows.append(current)
        return torch.cat(rows, dim=0), (torch.cat(before, dim=0) if processed else None)

    @staticmethod
    def _kept_mass(truncated: torch.Tensor, scores: torch.Tensor, rows: set[int]) -> list[float | None]:
        """Per row in `rows`: the log of the probability mass, under the distribution before truncation, of the
        tokens the truncating warpers and min_p kept (0.0 when nothing was dropped); None for the others."""
        index = torch.tensor(sorted(rows), dtype=torch.long, device=scores.device)
        before = torch.log_softmax(truncated.index_select(0, index), dim=-1)
        kept = torch.isfinite(scores.index_select(0, index))
        values = torch.logsumexp(before.masked_fill(~kept, -math.inf), dim=-1).cpu().tolist()
        mass: list[float | None] = [None] * scores.shape[0]
        for row, value in zip(sorted(rows), values):
            mass[row] = value
        return mass

    @staticmethod
    def _top_logprobs(raw: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, rows: list[int],
                      kwargs_per_row: list[dict], processed: set[int]):
        """For the rows asking `top_logprobs`: their n most likely tokens with their log-probabilities, and the
        chosen token's: the model's own (raw logits, before any processing) or, for a row in `processed`, those of
        the distribution it was sampled from."""
        index = torch.tensor(rows, dtype=torch.long)
        source = raw.index_select(0, index.to(raw.device))
        if processed:
            mine = torch.tensor([row in processed for row in rows], device=raw.device).view(-1, 1)
            source = torch.where(mine, scores.index_select(0, index.to(raw.device)), source)
        log_softmax = torch.log_softmax(source, dim=-1).cpu()
        chosen = log_softmax.gather(1, tokens.index_select(0, index).view(-1, 1)).squeeze(1).tolist()
        widest = max(kwargs_per_row[row][TOP_LOGPROBS_KWARG] for row in rows)
        values, ids = log_softmax.topk(widest, dim=-1)
        values, ids = values.tolist(), ids.tolist()
        top: list[tuple[list[int], list[float]] | None] = [None] * len(kwargs_per_row)
        for position, row in enumerate(rows):
            n = kwargs_per_row[row][TOP_LOGPROBS_KWARG]
            top[row] = (ids[position][:n], values[position][:n])
        return top, {row: chosen[position] for position, row in enumerate(rows)}
