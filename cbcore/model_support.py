"""Can cbcore serve this model exactly? Decided before the first request, never guessed.

cbcore runs a transformers model's own forward over a packed, padding-free batch and replaces only its attention
(docs/design.md, "What cbcore relies on in transformers"). That is exact for a model whose every layer attends through
transformers' `AttentionInterface`, once per forward, with the positions and the kwargs cbcore hands down, and whose
only per-request state is K/V. Anything else gives wrong tokens without an error, so it must be refused. Two lines of
defence:

1. `check_model_supported(model)`: structural checks, before the model is touched or the engine built. It reads the
   model's modules, signatures and config, not a list of model names. Layers that keep a per-request state through
   transformers' cache API (Mamba, Mamba-2, gated delta-nets, short convolutions: Qwen3.5, Qwen3-Next, Jamba, Bamba,
   Falcon-H1, Granite-4 hybrid, Nemotron-H, Zamba, LFM3, ...) are served on state slots (cbcore/state_layers.py).
   Refused, each with its reason:
   - layers that keep a recurrent or convolutional per-request state outside that API (RG-LRU, RWKV, xLSTM,
     MiniMax's lightning attention: RecurrentGemma, RWKV, xLSTM, MiniMax), whose state cbcore cannot reach;
   - a config without attention heads and without such stateful layers;
   - `layer_types` entries other than full or sliding-window attention (chunked attention, ...), besides the
     stateful and attention-free layer kinds of a model with state layers;
   - attention modules without a `layer_idx` (a shared block), or fewer/more attention layers than the cache has;
   - a sliding window set in the config but not passed to the attention function (it lives only in the mask);
   - a forward without `position_ids` whose positions are not computed in a cache-length positional embedding
     (BART-family decoders are served: cbcore/positions.py hands those modules the step's positions), or whose
     forward takes no keyword arguments at all. A forward without `logits_to_keep` (Whisper, TrOCR decoders) is
     served by computing every row's logits.
2. `self_check(model, ...)`: the safety net for what structure cannot see. A short prompt pair runs through cbcore's
   own paged path (the real `Scheduler`, `ModelRunner`, `PagedKVCache` and kernels, on a throwaway cache: chunked
   prefill, mixed prefill/decode steps, decodes over several pages) and its logits are compared with the model's own
   forward (`use_cache=False`, with the implementation that computes the model's true function: the one it was
   loaded with, or for transformers' paged spellings such as `paged|eager` their non-paged equivalent, see
   `reference_attn_implementation`) on the same tokens. Every layer's
   cbcore attention must be called exactly once per forward with cbcore's step data. Anything else (logits beyond
   the dtype's tolerance, a layer attended twice or never, an exception inside the step) raises
   `UnsupportedModelError` naming the model class and what was seen. This is what refuses attention that does not
   go through `AttentionInterface` (Bloom, Falcon, GPT-Neo, MPT: cbcore's attention is never called) and models
   that call one attention module several times per forward (DiffLlama). The manager runs it once per model (and dtype
   and device) at `start()`; it costs two short forwards of the model plus seven small steps, a fraction of a second
   for a small model (docs/performance_log.md, 2026-12-01). `CBCORE_SELF_CHECK=0` skips it.
"""

from __future__ import annotations

import functools
import inspect
import re
import weakref
from collections.abc import Iterator

import torch

from .cache import PagedKVCache
from .cache_shape import CacheShape
from .requests import RequestState, RequestStatus
from .positions import cache_length_position_embeddings
from .runner import ModelRunner
from .scheduler import FifoOrder, Scheduler
from .state_layers import StatePool, probe_state_specs, state_layer_modules
from .state_slots import StateSlots
from .switches import env_switch

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# Layer kinds a hybrid's config names for its stateful layers (a Mamba or delta-rule mixer, a short convolution, a
# layer with both attention, full or sliding, and a mixer) and for layers with neither (an MLP or MoE block alone):
# served when the model's stateful layers go through transformers' cache API.
STATE_MODEL_LAYER_TYPES = frozenset({"linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding", "moe", "mlp"})
SELF_CHECK_ENV = "CBCORE_SELF_CHECK"

# Module classes whose layer keeps a per-request recurrent/convolutional state that a KV cache cannot hold. Matched on
# the class name because these layers share no base class in transformers; the names are the field's vocabulary.
_STATEFUL_LAYER = re.compile(
    r"Mamba|ShortConv|GatedDeltaNet|DeltaNet|LinearAttention|LightningAttention|RecurrentBlock|Rglru|RGLRU|Rwkv|"
    r"xLSTM|mLSTM|sLSTM|SSM|Ssm|StateSpace|LinearAttn|GatedLinear|Recurrent"
)

# The names transformers gives a decoder layer's cross-attention module (BART-family and Whisper decoders, BERT-style
# decoders with add_cross_attention).
_CROSS_ATTENTION_NAMES = frozenset({"encoder_attn", "crossattention", "cross_attn", "cross_attention"})

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


class UnsupportedModelError(NotImplementedError):
    """cbcore cannot serve this model exactly; the message names the model class, the reason and what to do."""


def _unsupported(model: torch.nn.Module, reasons: list[str]) -> UnsupportedModelError:
    name = type(model).__name__
    return UnsupportedModelError(
        f"cbcore cannot serve {name} exactly: {'; '.join(reasons)}. cbcore refuses it rather than return wrong "
        f"tokens; serve {name} with `model.generate` (or another engine) instead"
    )


# ------------------------------------------------------------------------------------------- structure ----


def check_model_supported(model: torch.nn.Module) -> None:
    """Raise `UnsupportedModelError` if `model`'s structure rules out exact serving by cbcore (see the module
    docstring for each reason). Reads the model only; changes nothing."""
    reasons = unsupported_reasons(model)
    if reasons:
        raise _unsupported(model, reasons)


def unsupported_reasons(model: torch.nn.Module) -> list[str]:
    """Why cbcore cannot serve `model` exactly, from its structure; empty when the structure allows it (the
    start-up `self_check` still verifies the numbers)."""
    config = model.config.get_text_config()
    reasons: list[str] = []

    state_layers = [m for _, m in state_layer_modules(model)]
    inside = {id(sub) for layer in state_layers for sub in layer.modules()}
    if state_layers:
        # A model that keeps state through the cache API names its blocks and norms after it (MambaBlock,
        # MambaRMSNorm): only a convolution over the sequence outside those layers is a state cbcore cannot reach.
        # Any other hidden state would change the logits of the self-check's chunked prefill and decodes.
        stateful = sorted({type(m).__name__ for m in _decoder_layer_modules(model, config)
                           if isinstance(m, torch.nn.Conv1d) and id(m) not in inside})
    else:
        stateful = sorted({type(m).__name__ for m in _decoder_layer_modules(model, config) if _is_stateful(m)})
    if stateful:
        reasons.append(
            f"it has layers with a recurrent or convolutional per-request state ({', '.join(stateful[:4])}) that "
            "they keep outside transformers' cache API (get_conv_state / update_recurrent_state), where cbcore's "
            "state slots cannot reach it"
        )
    if not getattr(config, "num_attention_heads", None) and not state_layers:
        reasons.append("its config has no attention heads (num_attention_heads): there is no KV cache to page")
    kinds = _layer_kinds(config) - (STATE_MODEL_LAYER_TYPES if state_layers else frozenset())
    if kinds:
        reasons.append(
            f"its config's layer_types include {sorted(kinds)}: cbcore serves only full and sliding-window attention "
            "layers"
        )
    if reasons:
        return reasons  # the attention checks below would only restate these

    # A recurrent model without attention (Mamba) has no positions to get wrong: its state orders the tokens.
    position_free = bool(state_layers) and not attention_modules(model)
    reasons += _signature_reasons(model, position_free)
    reasons += _attention_reasons(model, config, {m.layer_idx for m in state_layers})
    if not reasons:
        try:  # the cache's own reading of the model: what its attention layers receive (or its config says)
            CacheShape.from_model(model, model.dtype)
        except (ValueError, AttributeError, TypeError) as error:
            reasons.append(f"its KV-cache shape cannot be derived exactly ({error})")
    return reasons


def language_root(model: torch.nn.Module) -> torch.nn.Module:
    """The language model (`get_decoder()`), or the whole model when it has none."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError, TypeError):
        decoder = None
    return decoder if isinstance(decoder, torch.nn.Module) else model


def _decoder_layer_modules(model: torch.nn.Module, config) -> Iterator[torch.nn.Module]:
    """The modules inside the decoder's layer stack: the language model's module lists with one entry per layer of
    the text config, preferring its direct children (`model.layers`, `transformer.h`) over lists nested in a vision or
    audio tower of the same length; every language-model module when there is no such list."""
    root = language_root(model)
    num_layers = getattr(config, "num_hidden_layers", None)
    direct = [m for m in root.children() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    stacks = direct or [m for m in root.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    if not stacks:
        yield from root.modules()
        return
    for stack in stacks:
        yield from stack.modules()


def _is_stateful(module: torch.nn.Module) -> bool:
    # A 1-D convolution inside a decoder layer runs over the sequence: it needs the previous tokens' inputs (a state).
    return isinstance(module, torch.nn.Conv1d) or bool(_STATEFUL_LAYER.search(type(module).__name__))


def _layer_kinds(config) -> set[str]:
    """Layer kinds other than attention named by the config (layer_types and the fields hybrids use instead)."""
    kinds: set[str] = set()
    for field in ("layer_types", "layers_block_type", "block_types", "layer_block_types"):
        value = getattr(config, field, None)
        if isinstance(value, (list, tuple)):
            kinds |= {str(kind) for kind in value if kind not in ATTENTION_LAYER_TYPES and kind != "attention"}
    return kinds


def _parameters(fn) -> tuple[set[str], bool]:
    """Named parameters of `fn` and whether it takes **kwargs."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return set(), True  # cannot tell: the self-check will
    params = signature.parameters.values()
    return {p.name for p in params}, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _signature_reasons(model: torch.nn.Module, position_free: bool = False) -> list[str]:
    names, takes_kwargs = _parameters(model.forward)
    reasons = []
    # position_ids may also travel through **kwargs to the language model (a multimodal wrapper's forward).
    root = language_root(model)
    reaches_decoder = takes_kwargs and root is not model and "position_ids" in _parameters(root.forward)[0]
    # A decoder that computes positions from a cache length in its positional embeddings gets the step's positions
    # there (cbcore/positions.py).
    positions_hooked = bool(cache_length_position_embeddings(root))
    if "position_ids" not in names and not reaches_decoder and not positions_hooked and not position_free:
        reasons.append(
            "its forward takes no position_ids (it computes positions itself, which is wrong for a packed batch of "
            "several requests and for chunked prefill)"
        )
    if not takes_kwargs:
        reasons.append("its forward takes no **kwargs, so cbcore's step data cannot reach the attention layers")
    return reasons


def _calls_attention_interface(module: torch.nn.Module) -> bool:
    """Whether the module's forward dispatches through transformers' `AttentionInterface` (the registry every
    attention implementation, cbcore's included, is looked up in)."""
    return "ALL_ATTENTION_FUNCTIONS" in _forward_source(module)


def _forward_source(module: torch.nn.Module) -> str:
    return _source_of(type(module).forward)


@functools.lru_cache(maxsize=1024)
def _source_of(function) -> str:
    # Cached per function: a model has hundreds of modules of a few classes, and reading a source file's tokens
    # again for each made the structural check cost 0.15 s of every generate_batch call on the default model.
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module in the decoder's layers whose forward attends through `AttentionInterface`,
    cross-attention to an encoder's states excepted: a decoder-only forward never calls it (and cbcore's attention
    refuses `encoder_hidden_states`; the self-check counts the calls each layer really makes)."""
    config = model.config.get_text_config()
    layers = set(map(id, _decoder_layer_modules(model, config)))
    return [
        (n, m) for n, m in model.named_modules()
        if id(m) in layers and _calls_attention_interface(m) and n.rsplit(".", 1)[-1] not in _CROSS_ATTENTION_NAMES
    ]


def _attention_reasons(model: torch.nn.Module, config, state_layer_indices: set[int]) -> list[str]:
    modules = attention_modules(model)
    if not modules and state_layer_indices:
        return []  # a recurrent model (Mamba): no attention to page
    if not modules:
        # Attention computed by the model itself (Bloom, Falcon, GPT-Neo, MPT, ...), or dispatched in a way this
        # reading of the source does not recognise: the self-check counts the calls cbcore's attention really gets
        # and refuses the model if a layer gets none.
        return []
    reasons = []
    no_index = [n for n, m in modules if not isinstance(getattr(m, "layer_idx", None), int)]
    if no_index:
        reasons.append(
            f"attention module {no_index[0]} has no integer layer_idx (a block shared between layers?), so cbcore "
            "cannot tell which layer's pages it reads"
        )
    indices = [m.layer_idx for n, m in modules if isinstance(getattr(m, "layer_idx", None), int)]
    expected = list(range(config.num_hidden_layers))
    if state_layer_indices:  # a hybrid: attention in some layers, at most one module each
        if not no_index and (len(set(indices)) != len(indices) or not set(indices) <= set(expected)):
            reasons.append(
                f"its attention modules have layer_idx {sorted(indices)[:12]} in a {config.num_hidden_layers}-layer "
                "model: cbcore pages K/V for at most one attention module per layer"
            )
    elif not no_index and sorted(indices) != expected:
        reasons.append(
            f"its attention modules have layer_idx {sorted(indices)[:12]} but the config has "
            f"{config.num_hidden_layers} layers: cbcore pages K/V for exactly one attention module per layer"
        )
    window = getattr(config, "sliding_window", None)
    if window and not any("sliding_window" in _forward_source(m) for _, m in modules):
        reasons.append(
            f"its config sets sliding_window={window} but its attention layers do not pass it to the attention "
            "function (the window lives only in the mask transformers builds, and cbcore's steps build none)"
        )
    # A decoder layer or attention module that drops the forward's **kwargs is served too: the step's metadata also
    # travels in a thread-local (attention.paged_step), and the self-check verifies the numbers.
    return reasons


# ------------------------------------------------------------------------------------------ self-check ----

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
        raise _unsupported(model, [str(error)]) from None
    # The reference is part of the key: a model checked under one implementation and switched to another (eager to
    # `paged|eager`, ...) is checked again against the new one's true function.
    key = (model.dtype, str(model.device), reference)
    if not force and key in _checked.get(model, set()):
        return
    problem = _run_self_check(model, reference)
    if problem is not None:
        raise _unsupported(model, [f"the start-up self-check failed: {problem}"])
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
    takes_positions = "position_ids" in _parameters(model.forward)[0]
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
