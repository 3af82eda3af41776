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
2. `self_check(model, ...)` (cbcore/model_self_check.py): the safety net for what structure cannot see, a short
   prompt pair through cbcore's own paged path against the model's own forward.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterator

import torch

from .cache_shape import CacheShape
from .positions import cache_length_position_embeddings
from .state_specs import state_layer_modules

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# Layer kinds a hybrid's config names for its stateful layers (a Mamba or delta-rule mixer, a short convolution, a
# layer with both attention, full or sliding, and a mixer) and for layers with neither (an MLP or MoE block alone):
# served when the model's stateful layers go through transformers' cache API.
STATE_MODEL_LAYER_TYPES = frozenset({"linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding", "moe", "mlp"})

# Module classes whose layer keeps a per-request recurrent/convolutional state that a KV cache cannot hold. Matched on
# the class name because these layers share no base class in transformers; the names are the field's vocabulary.
_STATEFUL_LAYER = re.compile(
    r"Mamba|ShortConv|GatedDeltaNet|DeltaNet|LinearAttention|LightningAttention|RecurrentBlock|Rglru|RGLRU|Rwkv|"
    r"xLSTM|mLSTM|sLSTM|SSM|Ssm|StateSpace|LinearAttn|GatedLinear|Recurrent"
)

# The names transformers gives a decoder layer's cross-attention module (BART-family and Whisper decoders, BERT-style
# decoders with add_cross_attention).
_CROSS_ATTENTION_NAMES = frozenset({"encoder_attn", "crossattention", "cross_attn", "cross_attention"})

class UnsupportedModelError(NotImplementedError):
    """cbcore cannot serve this model exactly; the message names the model class, the reason and what to do."""


def unsupported(model: torch.nn.Module, reasons: list[str]) -> UnsupportedModelError:
    """The error refusing `model` for these reasons."""
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
        raise unsupported(model, reasons)


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


def function_parameters(fn) -> tuple[set[str], bool]:
    """Named parameters of `fn` and whether it takes **kwargs."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return set(), True  # cannot tell: the self-check will
    params = signature.parameters.values()
    return {p.name for p in params}, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _signature_reasons(model: torch.nn.Module, position_free: bool = False) -> list[str]:
    names, takes_kwargs = function_parameters(model.forward)
    reasons = []
    # position_ids may also travel through **kwargs to the language model (a multimodal wrapper's forward).
    root = language_root(model)
    reaches_decoder = takes_kwargs and root is not model and "position_ids" in function_parameters(root.forward)[0]
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
    # travels in a thread-local (step_context.paged_step), and the self-check verifies the numbers.
    return reasons


def check_stateful_options(model: torch.nn.Module, compile_configs, tensor_parallel) -> None:
    """Refuse what cbcore does not do yet for a model with stateful layers (the compiled step, tensor parallelism),
    naming it: `compile_configs` the step's (varlen, decode) configs, `tensor_parallel` its group or None."""
    name = type(model).__name__
    if any(config is not None for config in compile_configs):
        raise NotImplementedError(
            f"{name} has layers with a per-request state, which cbcore runs per request outside a compiled graph; "
            "the compiled step is not supported for it yet: leave varlen_compile_config, decode_compile_config and "
            "default_compile_level unset (or set CBCORE_COMPILE=0)"
        )
    if tensor_parallel is not None:
        raise NotImplementedError(
            f"{name} has layers with a per-request state; tensor parallelism does not shard their state pool yet: "
            "serve it on one process"
        )

