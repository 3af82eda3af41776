"""`ContinuousBatchingConfig`: transformers' config class, with cbcore's validation and device checks.

cbcore's config *is* a transformers `ContinuousBatchingConfig` (a subclass), so every field has transformers' name and
default, the three deprecated fields (`use_default_compile_configs`, `max_cached_graphs`, `block_size`) warn and map
exactly as in transformers 5.24, and code that builds a transformers config can hand it to cbcore unchanged.

What cbcore adds:
- `validate()`: range checks that transformers spreads over its scheduler and resolver, done once and up front, with
  messages that say what to change;
- `check_supported(device)`: a field that cbcore cannot honour on this device raises instead of being ignored.
"""

from __future__ import annotations

import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig as _TransformersCBConfig

SCHEDULER_TYPES = ("fifo", "prefill_first")
MIN_PAGE_SIZE = 4  # same bound as transformers (initialization.BOUNDS)


class ContinuousBatchingConfig(_TransformersCBConfig):
    """Continuous batching settings, field for field those of transformers 5.24 (see its docstring for each field).

    How cbcore uses each field:
        page_size: tokens per page of the paged KV cache (>= 4).
        num_blocks: blocks in the cache; None sizes it from free memory (on CPU: a bounded share, see cache.py).
        max_batch_tokens: query-token budget of one step; longer prompts are split (chunked prefill).
        max_memory_percent: share of free memory the cache may take when `num_blocks` is None.
        max_requests_per_batch: request budget of one step.
        max_blocks_per_request: transformers sizes its flash decode block table with it; cbcore's block tables grow
            as needed, so it is only validated (>= 0).
        allow_block_sharing: prefix caching (on by default).
        scheduler_type: "fifo" (decodes first) or "prefill_first".
        safety_margin: share of blocks kept free before admitting new prefills (fifo default 0.15, prefill_first 0.0
            as in transformers).
        return_logprobs, seed, max_queue_size, per_request_processors: as in transformers.
        cpu_offload_space, cpu_offload_space_safety_threshold: a host pool (GiB; None = the whole cap) that
            preempted requests are swapped to, capped at the threshold share of RAM; works without a GPU.
        drop_unsupported_processors: cbcore applies every logits processor `model.generate` builds (with each
            request's real history), so there is nothing to drop; accepted for compatibility.
        auto_switch_to_flash, disable_nccl_graph_mixing, cpu_group_timeout: accepted; cbcore always runs its own paged
            attention in a single process, so they have no effect.
        use_cuda_graph, q/kv_padding_interval_size, varlen/decode_compile_config, default_compile_level,
            use_async_batching: not supported yet; asking for them raises
            NotImplementedError (see `check_supported`) rather than being ignored.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        self.validate()

    def validate(self) -> None:
        """Raise ValueError for out-of-range values, naming the field and the accepted range."""
        _check(self.page_size >= MIN_PAGE_SIZE, f"page_size must be at least {MIN_PAGE_SIZE}, got {self.page_size}")
        _check_optional_positive("num_blocks", self.num_blocks)
        _check_optional_positive("max_batch_tokens", self.max_batch_tokens)
        _check_optional_positive("max_requests_per_batch", self.max_requests_per_batch)
        if self.max_blocks_per_request is not None:
            _check(self.max_blocks_per_request >= 0, f"max_blocks_per_request must be >= 0, got {self.max_blocks_per_request}")
        if self.max_memory_percent is not None:
            _check(
                0 < self.max_memory_percent <= 1,
                f"max_memory_percent must be in (0, 1], got {self.max_memory_percent}",
            )
        if self.safety_margin is not None:
            _check(0 <= self.safety_margin <= 1, f"safety_margin must be in [0, 1], got {self.safety_margin}")
        _check(
            self.scheduler_type in SCHEDULER_TYPES,
            f"scheduler_type must be one of {SCHEDULER_TYPES}, got {self.scheduler_type!r}",
        )
        _check(self.max_queue_size >= 0, f"max_queue_size must be >= 0 (0 = unbounded), got {self.max_queue_size}")
        if self.cpu_offload_space is not None:
            _check(self.cpu_offload_space >= 0, f"cpu_offload_space must be >= 0 GiB, got {self.cpu_offload_space}")
        _check(
            0 <= self.cpu_offload_space_safety_threshold <= 1,
            "cpu_offload_space_safety_threshold must be in [0, 1], got "
            f"{self.cpu_offload_space_safety_threshold}",
        )
        _check(
            self.default_compile_level in (0, 1, 2, 3),
            f"default_compile_level must be 0..3, got {self.default_compile_level}",
        )

    def check_supported(self, device: torch.device) -> None:
        """Raise NotImplementedError for a field set to something cbcore cannot do (yet) on `device`."""
        wants_graphs = any(self.cuda_graph_booleans) or self.q_padding_interval_size or self.kv_padding_interval_size
        if wants_graphs:
            where = "on the CPU" if device.type != "cuda" else "yet"
            raise NotImplementedError(
                f"CUDA graphs (use_cuda_graph / *_padding_interval_size) are not supported {where}; "
                "leave use_cuda_graph=None and the padding intervals at 0"
            )
        compile_asked = self.varlen_compile_config or self.decode_compile_config or self.default_compile_level
        if compile_asked:
            raise NotImplementedError(
                "torch.compile of the forward (varlen/decode_compile_config, default_compile_level) is not supported "
                "yet; leave them unset"
            )
        if self.use_async_batching:
            raise NotImplementedError("use_async_batching=True is not supported yet; leave it None or False")


def as_cbcore_config(config: _TransformersCBConfig | None) -> ContinuousBatchingConfig:
    """A validated cbcore copy of `config` (which may be transformers' own class); the caller's object is untouched."""
    if config is None:
        return ContinuousBatchingConfig()
    fields = {name: getattr(config, name) for name in config.__dataclass_fields__}
    # The deprecated fields were already mapped when the caller's config was built; don't warn or map twice.
    for deprecated in ("use_default_compile_configs", "max_cached_graphs", "block_size"):
        fields[deprecated] = None
    return ContinuousBatchingConfig(**fields)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_optional_positive(name: str, value: int | None) -> None:
    if value is not None:
        _check(value >= 1, f"{name} must be >= 1 (or None to size it automatically), got {value}")
