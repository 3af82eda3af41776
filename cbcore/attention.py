"""The attention function cbcore registers with transformers' `AttentionInterface`.

Every attention layer of an unmodified transformers model calls `paged_attention(module, query, key, value, ...)`
with the packed batch (RoPE already applied). It writes the new K/V into the layer's pages, then attends over the
pages: the decode rows (one query token per request, packed first) through `ops.decode_attention`, the prefill rows
through `ops.prefill_attention`. All batch metadata comes from the `StepMetadata` the runner built once for the step
and passed through the forward's kwargs (transformers hands unknown kwargs down to the attention function unchanged).

The mask function registered under the same name returns None during cbcore's steps, so transformers never builds
an attention mask for them.

Attention kwargs (docs/design.md, "Kernels and their dispatch": nothing is silently ignored). In a step,
`sliding_window`, `softcap` (logit soft-capping: Gemma-2) and `s_aux` (attention sinks: GPT-OSS) go to the kernels; the
kwargs in `IGNORED_KWARGS` are known to change nothing about attention (each with the reason); any other kwarg, or a
value cbcore cannot honour (`is_causal=False`, `output_attentions=True`, dropout > 0), raises an error naming it rather
than being dropped.

Outside cbcore's steps (a user's own forward, `model.generate`, a training step while a manager is attached) the
model's own attention runs, so the model stays usable while cbcore holds it: a model that had "eager" runs its own
eager function (and eager's form of the mask); any other runs transformers' "sdpa" (a flash implementation's varlen
inputs cannot be rebuilt here). sdpa cannot honour `softcap` (it raises) and ignores `s_aux`, so a layer that passes
either runs its model's own eager attention too (what such models require in transformers anyway: Gemma-2 and
GPT-OSS do not support sdpa). The runner marks its
forward with `paged_step()`, a thread-local flag, because transformers calls the mask function without the forward's
kwargs.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import ops
from .step_context import (
    StepMetadata,
    WarmupStep,
    cpu_step_extension,
    current_step,
    in_paged_step,
    paged_step,
    tracing_compiled_step,
)

ATTENTION_NAME = "cbcore_paged"
STEP_KWARG = "cbcore_step"

# Attention kwargs the kernels take (see cbcore/ops): what they mean is implemented by every backend.
HANDLED_KWARGS = frozenset({"sliding_window", "softcap", "s_aux"})

# Attention kwargs transformers 5.24 models pass (or hand down from the forward's **kwargs) that change nothing about
# what cbcore's step computes, and why. Found by grepping every `attention_interface(...)` call of transformers'
# models and running the tiny models of the tests. Anything not here and not handled raises (see check_step_kwargs).
IGNORED_KWARGS = {
    "position_ids": "RoPE is applied before attention; the kernels take key positions from the step's block tables",
    "cache_position": "positions again, as position_ids",
    "use_cache": "transformers' own KV-cache flag; the runner passes use_cache=False and the pages are the cache",
    "output_hidden_states": "a flag for the model's outputs, not for attention",
    "output_router_logits": "a flag for MoE routers (GPT-OSS, Mixtral, ...), not for attention",
    "return_dict": "a flag for the model's outputs, not for attention",
    "num_items_in_batch": "loss normalisation for training",
    "cu_seq_lens_q": "transformers' varlen packing metadata; the step's own StepMetadata describes the packed batch",
    "cu_seq_lens_k": "transformers' varlen packing metadata (see cu_seq_lens_q)",
    "max_length_q": "transformers' varlen packing metadata (see cu_seq_lens_q)",
    "max_length_k": "transformers' varlen packing metadata (see cu_seq_lens_q)",
    "seq_idx": "sequence index of packed tokens for state-space layers; attention reads StepMetadata",
    "labels": "training targets a multimodal wrapper hands down with its kwargs (None in cbcore's steps); read by the "
    "loss only",
    "logits_to_keep": "the runner's choice of emitting rows, handed down from the forward; read by the LM head only",
    # Accepted only with the values cbcore computes (checked in check_step_kwargs):
    "encoder_hidden_states": "None only: a decoder-only run of an encoder-decoder block (BERT-style is_decoder) has "
    "no cross-attention; a tensor here would be cross-attention, which cbcore does not serve",
    "encoder_attention_mask": "None only (see encoder_hidden_states)",
    "is_causal": "None or True: cbcore's attention is causal (bottom-right aligned)",
    "output_attentions": "None or False: cbcore's kernels return no attention weights",
}

# Set on a bound model's modules (engine.model_binding): the implementation the model had, which its attention layers
# run outside cbcore's steps. "eager" runs the model's own eager function; anything else runs transformers' sdpa,
# whose mask the registered mask function builds (flash implementations take no such mask). A plain module attribute:
# it is in no state_dict and no saved config.
OUTSIDE_STEPS_ATTR = "_cbcore_outside_steps_attn_implementation"


def mark_outside_steps_implementation(model: torch.nn.Module, implementation: str | None) -> None:
    """Record (or, with None, forget) on every module of `model` the attention implementation its layers run outside
    cbcore's steps."""
    for module in model.modules():
        if implementation is None:
            module.__dict__.pop(OUTSIDE_STEPS_ATTR, None)
        else:
            module.__dict__[OUTSIDE_STEPS_ATTR] = implementation


class _ShapeProbe:
    """Passed as the step by `probe_kv_shapes`: each layer's attention records the K/V shapes it receives."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[int, int, int]] = {}

    def record(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """Note this layer's K/V shapes; answer zeros of the attention output's shape."""
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int):
            self.layers[layer] = (key.shape[1], key.shape[-1], value.shape[-1])
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
        return out, None


# model -> {(dtype, device): probe result}: a model's K/V shapes do not change, so it is probed once (every manager,
# check and self-check asks again).
_probed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def probe_kv_shapes(model: torch.nn.Module) -> dict[int, tuple[int, int, int]] | None:
    """{layer: (kv heads, K head dim, V head dim)} of what each attention layer of `model` receives, from one forward
    of one token through cbcore's attention in probe mode (it records and returns zeros; no cache is touched), or
    None when that forward cannot run. The model's attention implementation is restored before returning. Probed once
    per model, dtype and device."""
    key = (model.dtype, model.device)
    known = _probed.setdefault(model, {})
    if key not in known:
        known[key] = _probe(model)
    return known[key]


def _probe(model: torch.nn.Module) -> dict[int, tuple[int, int, int]] | None:
    register()
    config = model.config
    original = config._attn_implementation
    probe = _ShapeProbe()
    try:
        if original != ATTENTION_NAME:
            model.set_attn_implementation(ATTENTION_NAME)
        device = model.device
        kept = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        with torch.no_grad(), paged_step(probe):  # type: ignore[arg-type]
            model(input_ids=torch.ones(1, 1, dtype=torch.long, device=device),
                  position_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                  use_cache=False, **kept, **{STEP_KWARG: probe})
    except Exception:  # noqa: BLE001 - a model this forward cannot drive falls back to its config
        return None
    finally:
        if config._attn_implementation != original:
            model.set_attn_implementation(original)
    return probe.layers or None


def check_step_kwargs(kwargs: dict[str, Any], dropout: float = 0.0) -> None:
    """Raise ValueError naming any attention kwarg (or value) a cbcore step would otherwise have to drop silently.

    Handled kwargs go to the kernels; `IGNORED_KWARGS` are harmless; a kwarg transformers adds in a later version, or
    a model-specific one (`position_bias`, sparse-attention `indices`, ...), is refused until the kernels implement it.
    """
    unknown = sorted(set(kwargs) - HANDLED_KWARGS - set(IGNORED_KWARGS))
    if unknown:
        raise ValueError(
            f"cbcore's paged attention got attention kwarg(s) {', '.join(map(repr, unknown))} that it does not "
            "implement; ignoring them would give wrong tokens. This model's attention is not supported by cbcore "
            f"(handled: {', '.join(sorted(HANDLED_KWARGS))})."
        )
    for name in ("encoder_hidden_states", "encoder_attention_mask"):
        if kwargs.get(name) is not None:
            raise ValueError(f"cbcore's paged attention got {name} (cross-attention); it serves self-attention only")
    if kwargs.get("is_causal") is False:
        raise ValueError("cbcore's paged attention got is_causal=False (bidirectional attention); its kernels are "
                         "causal only")
    if kwargs.get("output_attentions"):
        raise ValueError("cbcore's paged attention got output_attentions=True; its kernels return no attention "
                         "weights")
    if dropout:
        raise ValueError(f"cbcore's paged attention got dropout={dropout} (a model in training mode?); its kernels "
                         "do not drop attention weights. Call model.eval() before serving.")


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature: query `[1, heads, T, d]`, key/value `[1, kv_heads, T, d]` / `[1, kv_heads,
    T, d_v]` -> `[1, T, heads, d_v]` (d_v: V's head dim, d unless the model has latent attention)."""
    step: StepMetadata | None = kwargs.pop(STEP_KWARG, None)
    # In a trace of cbcore's compiled step (cbcore/compiled_step.py) the step is not read here: the layer becomes one
    # opaque op that reads the step's batch layout when it runs, so no step's layout is baked into the graph
    # (the op's section at the end of this file says why).
    traced = tracing_compiled_step()
    if not traced:
        if step is None:
            step = current_step()  # a decoder layer dropped the forward's kwargs
        if isinstance(step, _ShapeProbe):
            return step.record(module, query, key, value)
        if isinstance(step, WarmupStep):  # as the compiled step's op answers while compiling ahead
            return step.attention(query, value), None
        if step is None:  # not one of cbcore's steps: the model's own implementation (see outside_steps_implementation)
            own = module.__dict__.get(OUTSIDE_STEPS_ATTR)
            needs_eager = kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
            has_eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None) is not None
            if needs_eager or (own == "eager" and has_eager):
                return _model_eager_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                          **kwargs)
    if attention_mask is not None:
        raise RuntimeError("cbcore's paged attention expects no attention mask; its mask function must return None")
    check_step_kwargs(kwargs, dropout)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    if traced:
        return torch.ops.cbcore.step_attention(query, key, value, module.layer_idx, scale, window, softcap, sinks), None
    return run_step_attention(step, module.layer_idx, query, key, value, scale, window, softcap, sinks), None


def run_step_attention(
    step: StepMetadata,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One layer's attention in `step`: write its new K/V into the layer's pages, then attend the decode rows and the
    prefill rows over them. Shapes as `paged_attention`'s (transformers' layout); returns `[1, T, heads, d_v]`."""
    k_cache, v_cache = step.key_caches[layer], step.value_caches[layer]
    q = query[0].transpose(0, 1)  # [T, heads, d]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)  # [T, kv_heads, v_head_dim]: V's head dim may differ from K's (MLA)

    mode = step.kernel_mode
    ops.cache_write(k, v, k_cache, v_cache, step.slot_mapping, mode)

    # The kernels write their rows of the output in place; their plans are the step's, made by the first layer.
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    num_decode = step.num_decode_tokens
    if num_decode:
        ops.decode_attention(
            q[:num_decode], k_cache, v_cache, step.decode_block_table, step.decode_seq_lens, scale, window, softcap,
            sinks, mode, step.kernel_plans, out[:num_decode],
        )
    if step.num_prefill_requests:
        ops.prefill_attention(
            q[num_decode:], k_cache, v_cache, step.prefill_block_table, step.prefill_cu_seqlens_q,
            step.prefill_seq_lens_k, scale, window, softcap, sinks, mode, step.kernel_plans, out[num_decode:],
        )
    return out.unsqueeze(0)


def _model_eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Outside a step, for a layer passing `softcap` or `s_aux`: the model's own `eager_attention_forward` (the
    function its modeling file defines and uses under "eager"), fed the eager form of the mask sdpa_mask made.

    sdpa_mask gives a boolean mask (True: attend) or None where sdpa may use its own causal flag; eager wants an
    additive float mask, always. Raises NotImplementedError when the model's module has no eager function.
    """
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        features = [name for name in ("softcap", "s_aux") if kwargs.get(name) is not None]
        raise NotImplementedError(
            f"{type(module).__name__} passes {' and '.join(features)} to its attention, which transformers' sdpa does "
            "not honour, and its module defines no eager_attention_forward to run instead; outside cbcore's steps "
            "this model needs its own attention implementation (stop the manager first)"
        )
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None:
        # What sdpa would have done: causal (is_causal=True, top-left aligned) for more than one query, else nothing.
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        if q_len > 1 and causal:
            attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()[None, None]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        min_value = torch.finfo(query.dtype).min  # as transformers' eager_mask
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, min_value)
    return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No mask in cbcore's steps, compiled or not (the kernels mask: causal, bottom-right aligned, sliding window);
    sdpa's otherwise."""
    if tracing_compiled_step() or in_paged_step():
        return None
    return sdpa_mask(*args, **kwargs)


_registered = False


def register() -> str:
    """Register cbcore's attention and (no-op) mask function with transformers; idempotent. Returns the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, paged_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, _mask)
        _registered = True
    return ATTENTION_NAME


# ---- One layer's whole step attention, for the compiled forward --------------------------------------------------
# The compiled forward traces the model's Python (norms, RoPE, MLPs) but not the step's batch layout: which rows are
# decode rows, the block tables, the CPU kernels' per-step plans. Those change every step, and as graph inputs they
# would make every step's count of decode rows a guard (a recompile) or force tensors where the kernels take plans.
# So one op per layer takes only what the layer computed (q, k, v: their token dimension is the graph's one dynamic
# size) and what is fixed at its call site (layer, scale, window, softcap, sinks), and reads the rest from the step
# the runner is executing (`current_step()`, set around the forward by `paged_step`), exactly as the eager
# attention function does. It writes the layer's new K/V into that step's pages: pages the graph never sees (they are
# not its inputs), so there is nothing for the compiler to order or functionalize around them.


# Defined with torch.library's lower-level API rather than `custom_op`: the compiled graph calls it once per layer per
# step, and `custom_op`'s Python wrapper (autograd redispatch, aliasing check, Dynamo guard) about doubled a call's
# cost against the same op defined this way (docs/performance_log.md, 2026-12-02, 12:40). It mutates nothing
# the graph sees, returns a fresh tensor, and has no autograd formula (the engine runs under inference mode).
_library = torch.library.Library("cbcore", "FRAGMENT")
_library.define(
    "step_attention(Tensor query, Tensor key, Tensor value, int layer, float scale, int? sliding_window=None, "
    "float? softcap=None, Tensor? sinks=None) -> Tensor"
)


def step_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
                   sliding_window: int | None = None, softcap: float | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Layer `layer`'s attention in the current cbcore step: query `[1, heads, T, d]`, key/value `[1, kv_heads, T,
    d]` / `[1, kv_heads, T, d_v]` (transformers' layout) -> `[1, T, heads, d_v]`. Raises RuntimeError outside a step.
    The implementation of `torch.ops.cbcore.step_attention` on every device."""
    step = current_step()
    if step is None:
        raise RuntimeError("torch.ops.cbcore.step_attention ran outside a cbcore step (paged_step was not entered)")
    if isinstance(step, WarmupStep):  # compiling ahead: no cache to attend over
        return step.attention(query, value)
    return run_step_attention(step, layer, query, key, value, scale, sliding_window, softcap, sinks)


_library.impl("step_attention", step_attention, "CompositeExplicitAutograd")
# On the CPU the op's kernel is C++ (csrc/attention/cpu_step_attention.cpp): inside a step whose context paged_step
# entered it runs the kernels itself, without this body's Python (docs/design.md, "The compiled step"); what it does not
# take it hands back to this function.
_step_extension = cpu_step_extension()
if _step_extension is not None:
    _step_extension.set_python_step_attention(step_attention)


@torch.library.register_fake("cbcore::step_attention")
def _(query, key, value, layer, scale, sliding_window=None, softcap=None, sinks=None):
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[-1])
