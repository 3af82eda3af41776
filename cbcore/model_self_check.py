"""The start-up self-check: the safety net for what cbcore/model_support.py's structural checks cannot see.

`self_check(model, ...)` runs a short prompt pair through cbcore's own paged path (the real `Scheduler`,
`ModelRunner`, `PagedKVCache` and kernels, on a throwaway cache: chunked prefill, mixed prefill/decode steps, decodes
over several pages) and compares its logits with the model's own forward (`use_cache=False`, with the implementation
that computes the model's true function: the one it was loaded with, or for transformers' paged spellings such as
`paged|eager` their non-paged equivalent, see `reference_attn_implementation`) on the same tokens. Every layer's
cbcore attention must be called exactly once per forward with cbcore's step data. Anything else (logits beyond the
dtype's tolerance, a layer attended twice or never, an exception inside the step) raises `UnsupportedModelError`
naming the model class and what was seen. This is what refuses attention that does not go through
`AttentionInterface` (Bloom, Falcon, GPT-Neo, MPT: cbcore's attention is never called) and models that call one
attention module several times per forward (DiffLlama). The manager runs it once per model (and dtype and device) at
`start()`; it costs two short forwards of the model plus seven small steps, a fraction of a second for a small model
(docs/performance_log.md, 2026-12-01). `CBCORE_SELF_CHECK=0` skips it.
"""

from __future__ import annotations

import functools
import re
import weakref

import torch

from .cache import PagedKVCache
from .cache_shape import CacheShape
from .model_support import attention_modules, function_parameters, unsupported
from .requests import RequestState, RequestStatus
from .runner import ModelRunner
from .scheduler import Scheduler
from .scheduling_orders import FifoOrder
from .state_layers import StatePool
from .state_specs import probe_state_specs, state_layer_modules
from .state_slots import StateSlots
from .switches import env_switch

SELF_CHECK_ENV = "CBCORE_SELF_CHECK"

# Tolerance of the self-check on logits, relative to the reference's largest |logit| (at least 1): sums in another
# order (kernels, packed linears) move fp32 logits by ~1e-5 relative and bf16 ones by ~1e-2 on the tests' tiny
# models; a model served wrongly moves them by O(1). A real model in bf16 moves further: SmolLM2-135M's logits
# differed by up to 0.078 on a Zen 3, where the reference's bf16 F.linear (no oneDNN bf16 there) and cbcore's
# skinny matmul (fp32 sums, one rounding) differ, and by 0.044 with the same matmuls on both sides (the rest: bf16
# attention inputs and K/V pages). bf16's tolerance leaves twice that room.
_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.float16: 3e-2, torch.bfloat16: 0.15}

# The self-check's throwaway engine: 8-token pages so that short prompts cross pages, a 7-token step budget so that
# the long prompt is chunked (8 + 8 + 4) and steps mix prefill and decode rows, 3 decode steps per request.
_CHECK_PAGE_SIZE = 8
_CHECK_BATCH_TOKENS = 7
_CHECK_PROMPT_LENGTHS = (19, 5)
_CHECK_DECODE_STEPS = 3


# Models (by identity, with dtype, device and reference implementation) that passed the self-check; weights do not
# matter to it.
_checked: weakref.WeakKeyDictionary[torch.nn.Module, set[tuple[torch.dtype, str, str | None]]] = (
    weakref.WeakKeyDictionary()
)


def self_check_enabled() -> bool:
    """`CBCORE_SELF_CHECK` (default on): 0/false/no/off skip the start-up self-check; anything else unknown raises."""
    return env_switch(SELF_CHECK_ENV)


class _CountingPages(list):
    """The step's per-layer K pages, counting each layer's reads: cbcore's attention reads its layer's K pages
    exactly once per call, so this counts attention calls per layer without touching the attention code."""

    def __init__(self, pages: list[torch.Tensor], counts: list[int]) -> None:
        super().__init__(pages)
        self.counts = counts

    def __getitem__(self, index):
        if isinstance(index, int):
            self.counts[index] += 1
        return super().__getitem__(index)


def self_check(model: torch.nn.Module, original_attn_implementation: str | None, force: bool = False) -> None:
    """Serve a short prompt pair through cbcore's own paged path and compare with the model's own forward; raise
    `UnsupportedModelError` naming the model and what differed. Call it with cbcore's attention (and packed
    linears) attached, before the loop starts. `original_attn_implementation` is the implementation the model was
    loaded with; the reference forward runs with `reference_attn_implementation(original_attn_implementation)`
    (switched to, then back); None keeps the current one.

    Runs on a throwaway cache, scheduler and runner, so the manager's cache, allocator and counters are untouched.
    Skipped for a model (and dtype, device, reference implementation) that passed before, unless `force`."""
    try:
        reference = reference_attn_implementation(original_attn_implementation)
    except ValueError as error:
        raise unsupported(model, [str(error)]) from None
    # The reference is part of the key: a model checked under one implementation and switched to another (eager to
    # `paged|eager`, ...) is checked again against the new one's true function.
    key = (model.dtype, str(model.device), reference)
    if not force and key in _checked.get(model, set()):
        return
    problem = _run_self_check(model, reference)
    if problem is not None:
        raise unsupported(model, [f"the start-up self-check failed: {problem}"])
    _checked.setdefault(model, set()).add(key)


def reference_attn_implementation(name: str | None) -> str | None:
    """The attention implementation that computes the true function of a model loaded with `name`: `name` itself,
    except for transformers' paged implementations, which compute it only inside transformers' own continuous
    batching (fed its packed inputs and block mask) and attend bidirectionally in an ordinary forward. Those map to
    their non-paged equivalent, as transformers 5.24 itself reads them:

    - `paged|X` (`paged|eager`, the one transformers registers; `paged|sdpa`, `paged|flash_attention_2`, ..., the
      spellings it still accepts by dropping the prefix) -> X;
    - a name registered with transformers' `AttentionInterface` for one of its paged functions -> the non-paged
      implementation of that function (`eager_paged_attention_forward` -> `eager`, `sdpa_attention_paged_forward`
      -> `sdpa`).

    ValueError for a paged implementation with no known equivalent (transformers' deprecated flash `paged_attention_
    forward` registered under another name, `paged|` with nothing after it, or an unregistered name such as `paged`
    or `sdpa_paged`): there is then nothing to check cbcore's steps against, so it is refused rather than guessed.
    None stays None (keep the current implementation)."""
    if name is None:
        return None
    if name.startswith(_PAGED_PREFIX):
        inner = name[len(_PAGED_PREFIX):]
        if not inner:
            raise ValueError(f"the attention implementation {name!r} names no implementation after `paged|`; load "
                             "the model with 'eager', 'sdpa' or 'paged|eager'")
        return reference_attn_implementation(inner)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registered = ALL_ATTENTION_FUNCTIONS.get(name) if name in ALL_ATTENTION_FUNCTIONS.valid_keys() else None
    paged_function = registered is not None and registered in _paged_functions()
    unregistered_paged = registered is None and "paged" in re.split(r"[|_\-]", name)
    if not paged_function and not unregistered_paged:
        return name
    equivalent = _paged_functions().get(registered) if paged_function else None
    if equivalent is None:
        raise ValueError(
            f"the attention implementation {name!r} is a paged one with no non-paged equivalent that cbcore knows, so "
            "the start-up self-check has nothing to compare cbcore's steps with; load the model with 'eager', 'sdpa' "
            "or 'paged|eager'"
        )
    return equivalent


_PAGED_PREFIX = "paged|"


@functools.lru_cache(maxsize=1)
def _paged_functions() -> dict:
    """transformers' paged attention functions -> the non-paged implementation computing the same attention (None:
    none that cbcore can name)."""
    from transformers.integrations.eager_paged import eager_paged_attention_forward
    from transformers.integrations.flash_paged import paged_attention_forward
    from transformers.integrations.sdpa_paged import sdpa_attention_paged_forward

    return {eager_paged_attention_forward: "eager", sdpa_attention_paged_forward: "sdpa", paged_attention_forward: None}


def _run_self_check(model: torch.nn.Module, reference_attn_implementation: str | None) -> str | None:
    """What the self-check saw wrong, or None. Only the model's forwards are guarded: an error in building the
    throwaway engine is cbcore's own and propagates as it is."""
    device = model.device
    shape = CacheShape.from_model(model, model.dtype)
    longest = max(_CHECK_PROMPT_LENGTHS) + _CHECK_DECODE_STEPS
    num_blocks = sum(-(-(n + _CHECK_DECODE_STEPS) // _CHECK_PAGE_SIZE) for n in _CHECK_PROMPT_LENGTHS) + 1
    # A model with stateful layers gets a throwaway state pool too: its chunked prefill and decodes run on slots.
    state_specs = probe_state_specs(model) if state_layer_modules(model) else []
    num_slots = 4
    state_slots = StateSlots(num_slots) if state_specs else None
    cache = PagedKVCache(shape, num_blocks, _CHECK_PAGE_SIZE, device, allow_prefix_sharing=False,
                         state_slots=state_slots)
    scheduler = Scheduler(cache, FifoOrder(), max_batch_tokens=_CHECK_BATCH_TOKENS, max_requests_per_batch=num_slots,
                          safety_margin=0.0)
    runner = ModelRunner(model, cache, sampler=None,
                         state_pool=StatePool(state_specs, num_slots, device) if state_specs else None)

    vocab = min(model.get_input_embeddings().num_embeddings, model.config.get_text_config().vocab_size)
    generator = torch.Generator().manual_seed(0)
    states = [
        RequestState(request_id=f"cbcore_self_check_{i}",
                     initial_tokens=torch.randint(0, vocab, (n,), generator=generator).tolist(),
                     max_new_tokens=_CHECK_DECODE_STEPS)
        for i, n in enumerate(_CHECK_PROMPT_LENGTHS)
    ]
    for state in states:
        scheduler.add(state)

    rows: dict[str, list[tuple[int, torch.Tensor]]] = {state.request_id: [] for state in states}
    num_layers = shape.num_layers
    # Every layer attends once per step; in a model with stateful layers, exactly the layers with an attention module.
    if state_specs:
        attending = {m.layer_idx for _, m in attention_modules(model)}
        expected_counts = [1 if layer in attending else 0 for layer in range(num_layers)]
    else:
        expected_counts = [1] * num_layers
    for _ in range(4 * longest):  # bounded: each step computes at least one token
        if not scheduler.has_work():
            break
        batch = scheduler.schedule()
        if batch.failed or batch.filled_the_cache or not batch.requests:
            return f"the throwaway engine could not schedule the check ({batch.failed or batch.filled_the_cache})"
        counts = [0] * num_layers

        def count_calls(step, counts=counts):
            step.key_caches = _CountingPages(step.key_caches, counts)
            return step

        runner.copy_blocks(batch.copies)
        try:
            logits, indices = runner.forward(batch.plan(), step_hook=count_calls)
            emitted = [batch.requests[i] for i in indices]
        except Exception as error:  # noqa: BLE001 - whatever breaks in a step means the model is not served exactly
            return f"cbcore's paged forward raised {type(error).__name__}: {error}"
        if counts != expected_counts:
            return _describe_counts(counts, expected_counts)
        scheduler.on_step_done(batch)
        for item, row in zip(emitted, logits if logits is not None else []):
            state = item.state
            rows[state.request_id].append((state.num_tokens - 1, row.float()))
            state.status = RequestStatus.DECODING
            if state.append_token(int(row.argmax()), None):
                scheduler.finish(state)
    if scheduler.has_work():
        return "the throwaway engine did not finish the check"

    tolerance = _TOLERANCE.get(model.dtype, 6e-2)
    takes_positions = "position_ids" in function_parameters(model.forward)[0]
    with _attention_implementation(model, reference_attn_implementation), torch.inference_mode():
        for state in states:
            ids = torch.tensor([state.all_tokens], device=device)
            # With an all-ones mask and, where the forward takes them, explicit 0-based positions, as
            # `model.generate` calls it: some models apply their sliding window only when a mask is given (Moshi),
            # and RoBERTa-style embeddings offset positions by the padding index only when they compute them.
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
            if takes_positions:
                inputs["position_ids"] = torch.arange(ids.shape[1], device=device)[None]
            try:
                reference = model(**inputs).logits[0].float()
            except Exception as error:  # noqa: BLE001
                return f"the model's own forward raised {type(error).__name__}: {error} on the check's prompt"
            for position, got in rows[state.request_id]:
                want = reference[position]
                difference = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
                if difference > tolerance:
                    return (
                        f"logits at position {position} of a {len(state.initial_tokens)}-token prompt differ from the "
                        f"model's own forward by {difference:.3g} (relative; tolerance {tolerance:g} for {model.dtype}), "
                        f"so cbcore's paged steps do not compute what this model computes"
                    )
    return None


def _describe_counts(counts: list[int], expected: list[int]) -> str:
    never = [i for i, (c, e) in enumerate(zip(counts, expected)) if c == 0 and e]
    several = [i for i, c in enumerate(counts) if c > 1]
    unexpected = [i for i, (c, e) in enumerate(zip(counts, expected)) if c == 1 and not e]
    parts = []
    if never:
        parts.append(f"layers {never[:8]} never called cbcore's attention with its step data (their attention "
                     "bypasses it, or a layer drops the forward's kwargs)")
    if several:
        parts.append(f"layers {several[:8]} called it {max(counts)} times in one forward (one attention module used "
                     "several times, or shared between layers)")
    if unexpected:
        parts.append(f"layers {unexpected[:8]}, which have no attention module, called cbcore's attention")
    return "; ".join(parts)


class _attention_implementation:
    """Temporarily switch the model to `name` (None: keep the current implementation)."""

    def __init__(self, model: torch.nn.Module, name: str | None) -> None:
        self.model = model
        self.name = name
        self.previous: str | None = None

    def __enter__(self) -> None:
        if self.name is not None:
            self.previous = self.model.config._attn_implementation
            if self.previous != self.name:
                self.model.set_attn_implementation(self.name)
            else:
                self.previous = None

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            self.model.set_attn_implementation(self.previous)
