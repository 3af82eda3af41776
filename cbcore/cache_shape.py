"""What one token costs in the KV cache: per layer, the KV heads and the K and V head dims its attention receives,
read off the model itself (a probe forward) or its config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import probe_kv_shapes
from .state_specs import state_layer_modules


@dataclass(frozen=True)
class CacheShape:
    """What one token costs in the cache: per layer, the KV heads and the K and V head dims its attention receives.

    Most models have one shape for every layer (`num_kv_heads`, `head_dim`, `v_head_dim`); a model whose layers differ
    (Gemma-4's sliding and global layers, per-layer KV head counts) has `per_layer` set, one (kv heads, K head dim,
    V head dim) per layer, and its pages are allocated layer by layer with their own shape.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int  # K's (and the queries')
    dtype: torch.dtype
    v_head_dim: int | None = None  # V's when it differs from K's (multi-head latent attention); None: head_dim
    per_layer: tuple[tuple[int, int, int], ...] | None = None  # when the layers differ

    @property
    def value_head_dim(self) -> int:
        """The head dim of the V pages (of layer 0 when the layers differ)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def uniform(self) -> bool:
        """One K/V page shape for every layer, the same for K and V (what the host swap pool holds)."""
        return self.per_layer is None and self.value_head_dim == self.head_dim

    def layer_dims(self, layer: int) -> tuple[int, int, int]:
        """(kv heads, K head dim, V head dim) of one layer."""
        if self.per_layer is not None:
            return self.per_layer[layer]
        return self.num_kv_heads, self.head_dim, self.value_head_dim

    @property
    def bytes_per_token(self) -> int:
        """K and V over every layer."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return sum(heads * (k + v) for heads, k, v in map(self.layer_dims, range(self.num_layers))) * element

    @classmethod
    def from_model_config(cls, config, dtype: torch.dtype) -> CacheShape:
        """Layers, KV heads and K/V head dims of a transformers text config (per layer for a heterogeneous config).

        ValueError, naming the config and the field, when the dims cannot be derived exactly.
        """
        config = config.get_text_config()
        if getattr(config, "is_heterogeneous", False):
            per_layer = [_attention_dims(layer) for layer in config.per_layer_config]
            return cls.from_layers(per_layer, dtype)
        num_kv_heads, head_dim, v_head_dim = _attention_dims(config)
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, dtype,
                   None if v_head_dim == head_dim else v_head_dim)

    @classmethod
    def from_layers(cls, per_layer: list[tuple[int, int, int]], dtype: torch.dtype) -> CacheShape:
        """The shape of layers whose (kv heads, K head dim, V head dim) are given one by one."""
        num_kv_heads, head_dim, v_head_dim = per_layer[0]
        layers = None if len(set(per_layer)) == 1 else tuple(per_layer)
        return cls(len(per_layer), num_kv_heads, head_dim, dtype, None if v_head_dim == head_dim else v_head_dim,
                   layers)

    @classmethod
    def from_model(cls, model: torch.nn.Module, dtype: torch.dtype) -> CacheShape:
        """The shape of what `model`'s attention layers really receive: read off one probe forward (a token through
        cbcore's attention function, which records each layer's K/V shapes), since a config does not always say
        (JetMoE's heads depend on its experts, some configs name per-layer head counts their own way). Falls back
        to the config when the probe cannot run; the start-up self-check verifies the numbers either way."""
        probed = probe_kv_shapes(model)
        config = model.config.get_text_config()
        layers = list(range(config.num_hidden_layers))
        if probed and sorted(probed) != layers and state_layer_modules(model):
            # A hybrid (attention in some layers, a stateful mixer in the others): every layer gets the attention
            # layers' page shape, so that the host pool's one block shape holds them. The stateful layers' pages
            # are never read; sizing them to nothing is left for later (docs/design.md, "Per-request state").
            shapes = set(probed.values())
            if len(shapes) == 1:
                return cls.from_layers([next(iter(shapes))] * len(layers), dtype)
        if probed is None and state_layer_modules(model) and not getattr(config, "num_attention_heads", None):
            # A recurrent model without attention (Mamba): pages of one element per token and layer. The blocks still
            # bound each request's tokens and carry the scheduler's bookkeeping; attention never reads them.
            return cls(len(layers), 1, 1, dtype)
        if probed is None or sorted(probed) != layers:
            return cls.from_model_config(model.config, dtype)
        return cls.from_layers([probed[layer] for layer in layers], dtype)


def _attention_dims(config) -> tuple[int, int, int]:
    """(kv heads, K head dim, V head dim) of the K/V that one layer hands its attention function."""
    name = type(config).__name__

    def positive(field: str, value) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}.{field} is {value!r}; cbcore needs a positive integer to size its KV cache")
        return value

    num_heads = positive("num_attention_heads", getattr(config, "num_attention_heads", None))
    nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    if nope is not None and rope is not None:
        # Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3): transformers expands the latent into per-head K/V
        # before calling attention (DeepseekV3Attention.expand_kv): one K/V head per query head, K = nope + rope
        # dims, V = v_head_dim. config.head_dim is only the rotary part there, not K's head dim.
        v_head_dim = positive("v_head_dim", getattr(config, "v_head_dim", None))
        return num_heads, positive("qk_nope_head_dim", nope) + positive("qk_rope_head_dim", rope), v_head_dim
    num_kv_heads = positive("num_key_value_heads", getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        hidden = positive("hidden_size", getattr(config, "hidden_size", None))
        if hidden % num_heads:
            raise ValueError(f"{name}: hidden_size {hidden} is not a multiple of num_attention_heads {num_heads} and "
                             "head_dim is unset; cbcore cannot derive the head dim of its KV cache")
        head_dim = hidden // num_heads
    head_dim = positive("head_dim", head_dim)
    v_head_dim = getattr(config, "v_head_dim", None)
    if v_head_dim is not None and v_head_dim != head_dim:
        # A V head dim without the latent-attention fields: how the model shapes its V is not known here.
        raise ValueError(f"{name}: v_head_dim {v_head_dim} differs from head_dim {head_dim} outside multi-head latent "
                         "attention (no qk_nope_head_dim / qk_rope_head_dim); cbcore cannot derive its KV cache shape")
    return num_kv_heads, head_dim, head_dim
