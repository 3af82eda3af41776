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

import math

import torch
from transformers.generation.configuration_utils import CompileConfig
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
        auto_switch_to_flash: accepted; cbcore always runs its own paged attention, so it has no effect.
        cpu_group_timeout: under tensor parallelism, the timeout of the CPU group the driver sends each step over
            (cbcore/distributed/): no rank waits longer than that for another; None is torch's default (30 min).
        disable_nccl_graph_mixing: as in transformers (its `__post_init__`, inherited): sets
            NCCL_GRAPH_MIXING_SUPPORT=0 when WORLD_SIZE > 1, and a warning when a NCCL group existed before.
        q/kv_padding_interval_size: they only shape CUDA graphs; accepted (and unused) while graphs are off.
        varlen_compile_config, decode_compile_config, default_compile_level (and the deprecated
            use_default_compile_configs, mapped as transformers maps it): torch.compile of the step's forward, on
            every device, resolved as transformers resolves them (cbcore/compiled_step.py: the levels, and
            CBCORE_COMPILE=0 to turn compilation off).
        use_cuda_graph, use_async_batching: not supported yet; asking for them raises NotImplementedError (see
            `check_supported`) rather than being ignored.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        self.validate()

    def validate(self) -> None:
        """Raise TypeError / ValueError for a field of the wrong type or out of range, naming the field and what it
        accepts (a string or a float in `page_size`, say, used to surface as an unnamed error deep in the engine)."""
        for name, kind, optional in _FIELD_TYPES:
            _check_type(name, getattr(self, name), kind, optional)
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
        if self.seed is not None:
            _check(0 <= self.seed < 2**64, f"seed must be in [0, 2**64) (torch.Generator.manual_seed), got {self.seed}")
        for name in ("q_padding_interval_size", "kv_padding_interval_size"):
            _check(getattr(self, name) >= 0, f"{name} must be >= 0 (0 = transformers' default), got {getattr(self, name)}")
        if self.cpu_group_timeout is not None:
            _check(self.cpu_group_timeout > 0, f"cpu_group_timeout must be > 0 seconds, got {self.cpu_group_timeout}")
        for name in ("varlen_compile_config", "decode_compile_config"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, CompileConfig):
                raise TypeError(f"{name} must be None, a transformers CompileConfig or a dict of its fields, got "
                                f"{value!r}")
        graphs = self.use_cuda_graph
        if isinstance(graphs, tuple):
            _check(
                len(graphs) == 2 and all(isinstance(flag, bool) for flag in graphs),
                f"use_cuda_graph must be a bool or a pair of bools (varlen, decode), got {graphs!r}",
            )
        elif graphs is not None and not isinstance(graphs, bool):
            raise TypeError(f"use_cuda_graph must be None, a bool or a pair of bools, got {graphs!r}")

    def check_supported(self, device: torch.device) -> None:
        """Raise NotImplementedError for a field set to something cbcore cannot do (yet) on `device`."""
        # The padding intervals only shape CUDA graphs: with graphs off they change nothing, and transformers accepts
        # them then too.
        if any(self.cuda_graph_booleans):
            where = "on the CPU" if device.type != "cuda" else "yet"
            raise NotImplementedError(
                f"CUDA graphs (use_cuda_graph={self.use_cuda_graph!r}) are not supported {where}; leave use_cuda_graph "
                "None or False"
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


# Every plain field and its type ("int": a Python int, never a bool or a float; "float": an int or a finite float;
# "bool": True or False), and whether None is allowed. Compile configs and use_cuda_graph are checked on their own.
_FIELD_TYPES = (
    ("page_size", "int", False),
    ("num_blocks", "int", True),
    ("max_batch_tokens", "int", True),
    ("max_memory_percent", "float", True),
    ("max_requests_per_batch", "int", True),
    ("max_blocks_per_request", "int", True),
    ("allow_block_sharing", "bool", False),
    ("use_async_batching", "bool", True),
    ("q_padding_interval_size", "int", False),
    ("kv_padding_interval_size", "int", False),
    ("default_compile_level", "int", False),
    ("scheduler_type", "str", False),
    ("safety_margin", "float", True),
    ("return_logprobs", "bool", False),
    ("seed", "int", True),
    ("auto_switch_to_flash", "bool", False),
    ("cpu_offload_space", "float", True),
    ("cpu_offload_space_safety_threshold", "float", False),
    ("max_queue_size", "int", False),
    ("per_request_processors", "bool", False),
    ("drop_unsupported_processors", "bool", False),
    ("disable_nccl_graph_mixing", "bool", False),
    ("cpu_group_timeout", "float", True),
)
_KIND_WORDS = {"int": "an int", "float": "a number", "bool": "True or False", "str": "a str"}


def _check_type(name: str, value: object, kind: str, optional: bool) -> None:
    if value is None:
        if optional:
            return
        raise TypeError(f"{name} must be {_KIND_WORDS[kind]}, got None")
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, str)
    if not ok:
        allowed = _KIND_WORDS[kind] + (" or None" if optional else "")
        raise TypeError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_optional_positive(name: str, value: int | None) -> None:
    if value is not None:
        _check(value >= 1, f"{name} must be >= 1 (or None to size it automatically), got {value}")
