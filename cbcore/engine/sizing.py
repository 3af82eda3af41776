"""How big the engine is: the step budgets, the number of cache blocks and of host-pool blocks, from the config, the
workload hints and the memory available (transformers infers its budgets from GPU memory; on a CPU cbcore bounds the
cache, since it shares RAM with everything else). Host memory is what this process may really take: the RAM
available, its cgroup's memory limit and its address-space limit, the least of them (`host_memory`). An allocation
that still fails is reported naming the option that sized it (`allocation_error`)."""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from transformers.generation.continuous_batching.utils import WorkloadHints

from ..cache_shape import CacheShape
from ..config import ContinuousBatchingConfig

# Default step budgets when the config leaves them None (transformers infers them from GPU memory). On a CPU a
# prefill step's linears run faster per token up to about 2048 rows, and 4096 gained nothing more over 2048
# (docs/performance_log.md, 2026-12-03, "what a step does besides its kernels"). vLLM's CPU defaults are 4096 (LLM)
# and 2048 (its server).
DEFAULT_MAX_BATCH_TOKENS = {"cpu": 2048, "cuda": 8192}
FALLBACK_MAX_REQUESTS_PER_BATCH = 1024  # transformers' fallback
# State slots (models with stateful layers) when max_requests_per_batch is left to its fallback: vLLM's default
# max_num_seqs on a GPU; on a CPU more requests at once than this only lengthen each step. Set
# max_requests_per_batch to have more. The pool never takes more than STATE_MEMORY_SHARE of the memory available.
DEFAULT_STATE_SLOTS = {"cpu": 64, "cuda": 256}
STATE_MEMORY_SHARE = 0.25
# On a CPU the KV cache lives in the same RAM as everything else; never take more than this by default, so a small
# model on a laptop-sized machine cannot push it into swap (transformers takes 60% of free RAM on CPU). 1 GiB holds
# 64 requests of 512 tokens for a 32-layer model with 8 KV heads of 128 in bf16 / 16 layers in fp32; a workload that
# would need more is preempted (swap or recompute) rather than given more RAM, unless `num_blocks` says otherwise.
CPU_CACHE_CAP_BYTES = 2**30
CPU_MAX_MEMORY_PERCENT = 0.6  # transformers' default on CPU; cbcore also caps the bytes (CPU_CACHE_CAP_BYTES)
# An explicit num_blocks may take at most this share of the memory available when the cache is allocated: beyond it
# the allocation would push the machine into swap or fail with a raw allocator error.
MAX_EXPLICIT_CACHE_SHARE = 0.9


GIB = 2**30
# A limit this large means "no limit" (cgroup v1 writes 2**63 rounded down to a page; v2 writes "max").
_UNLIMITED = 2**60
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class HostMemory:
    """The host memory this process may still take: the least of the RAM available, what its cgroup's memory limit
    leaves, and what its address-space limit (`RLIMIT_AS`) leaves. `bound` names the one that decided it. A cgroup
    limit is enforced by the OOM killer when pages are first touched (long after the allocation succeeded), and
    `RLIMIT_AS` by a failed allocation: sizing against RAM alone lets either kill or fail a process that asked for
    what the machine has."""

    available: int
    bound: str
    total: int  # physical RAM


def host_memory() -> HostMemory:
    """What host memory this process may take now (see `HostMemory`)."""
    memory = psutil.virtual_memory()
    bounds = [(memory.available, "the RAM available")]
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        bounds.append(cgroup)
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        mapped = psutil.Process().memory_info().vms
        bounds.append((max(soft - mapped, 0), f"the address-space limit (RLIMIT_AS {gib(soft)} GiB, "
                                              f"{gib(mapped)} GiB mapped already)"))
    available, bound = min(bounds, key=lambda b: b[0])
    return HostMemory(available, bound, memory.total)


def _cgroup_headroom(root: Path = _CGROUP_ROOT, membership: Path = _PROC_CGROUP) -> tuple[int, str] | None:
    """(bytes left under the tightest memory limit of this process's cgroup and its ancestors, that limit's
    description), or None when none has a limit. Reclaimable page cache (the inactive file pages, as `docker stats`
    counts them) is not counted as used: the kernel drops it before it kills anything, and the model's weights just
    read from disk leave much of it."""
    headrooms = []
    for folder, limit_name, usage_name, inactive_key in _cgroup_folders(root, membership):
        try:
            text = (folder / limit_name).read_text().strip()
            limit = _UNLIMITED if text == "max" else int(text)
            if limit >= _UNLIMITED:
                continue
            usage = int((folder / usage_name).read_text())
        except (OSError, ValueError):
            continue
        used = max(usage - _stat_value(folder / "memory.stat", inactive_key), 0)
        headrooms.append((max(limit - used, 0), f"the cgroup memory limit ({folder / limit_name}: {gib(limit)} GiB)"))
    return min(headrooms, key=lambda h: h[0]) if headrooms else None


def _cgroup_folders(root: Path, membership: Path) -> list[tuple[Path, str, str, str]]:
    """The folders whose memory limit binds this process, with their files' names: the mount's root (a container
    with its own cgroup namespace sees its group there) and the group named in /proc/self/cgroup with its ancestors
    (a process in a sub-group of the mount), for cgroup v2 and v1."""
    v2 = ("memory.max", "memory.current", "inactive_file")
    v1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    folders = {(root, *v2), (root / "memory", *v1)}
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hierarchy, controllers, path = parts
        if controllers == "":
            mount, names = root, v2
        elif "memory" in controllers.split(","):
            mount, names = root / "memory", v1
        else:
            continue
        folder = mount / path.strip("/")
        while folder != mount and mount in folder.parents:
            folders.add((folder, *names))
            folder = folder.parent
    return sorted(folders)


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _device_memory(device: torch.device) -> tuple[int, str]:
    """(bytes this process may take on `device` now, what bounds it)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, f"the free memory of {device}"
    memory = host_memory()
    return memory.available, memory.bound


@dataclass(frozen=True)
class EngineSizes:
    """The resolved sizes: what the config left None, filled in."""

    num_blocks: int
    max_batch_tokens: int
    max_requests_per_batch: int
    num_state_slots: int = 0  # per-request state slots, for a model with stateful layers (0 without)


def plan_sizes(
    model: torch.nn.Module, shape: CacheShape, cfg: ContinuousBatchingConfig, hints: WorkloadHints | None,
    state_bytes_per_request: int = 0,
) -> EngineSizes:
    """Budgets and block count for `model` on its device. An explicit `num_blocks` that does not fit in the memory
    available is refused here, naming it, rather than failing in the allocator. `state_bytes_per_request`: what one
    running request's states take in a model with stateful layers (one slot per request of a step's budget, set
    aside before the blocks are sized)."""
    device = model.device
    max_requests = cfg.max_requests_per_batch
    wanted = hints.num_requests if hints is not None and hints.num_requests > 0 else None
    if max_requests is None:
        max_requests = min(wanted or FALLBACK_MAX_REQUESTS_PER_BATCH, FALLBACK_MAX_REQUESTS_PER_BATCH)
    max_batch_tokens = cfg.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS.get(device.type, 2048)
    num_state_slots = 0
    if state_bytes_per_request:
        num_state_slots = plan_num_state_slots(min(max_requests, max_batch_tokens),
                                               cfg.max_requests_per_batch is not None or wanted is not None,
                                               state_bytes_per_request, device)
    num_blocks = cfg.num_blocks
    if num_blocks is None:
        percent = cfg.max_memory_percent or (CPU_MAX_MEMORY_PERCENT if device.type != "cuda" else 0.9)
        useful = None
        if hints is not None and hints.num_requests > 0 and hints.max_prompt_length > 0:
            longest = hints.max_prompt_length + max(hints.max_generated_length, 1)
            useful = useful_blocks(hints.num_requests, longest, cfg.page_size)
        reserved = activation_bytes(model, max_batch_tokens, max_requests)
        reserved += num_state_slots * state_bytes_per_request
        num_blocks = plan_num_blocks(shape, cfg.page_size, device, percent, reserved, useful)
    else:
        check_cache_fits(shape, num_blocks, cfg.page_size, device)
    return EngineSizes(num_blocks, max_batch_tokens, min(max_requests, max_batch_tokens), num_state_slots)


def plan_num_state_slots(max_requests: int, asked: bool, bytes_per_slot: int, device: torch.device) -> int:
    """State slots for a model with stateful layers: one per request a step may run (`max_requests`) when the config
    or the workload hints said how many; otherwise at most `DEFAULT_STATE_SLOTS`. Never more than
    `STATE_MEMORY_SHARE` of the memory available; ValueError when not even one fits."""
    slots = max_requests if asked else min(max_requests, DEFAULT_STATE_SLOTS.get(device.type, 64))
    available, bound = _device_memory(device)
    affordable = int(STATE_MEMORY_SHARE * available // bytes_per_slot)
    if affordable < 1:
        raise ValueError(
            f"one request's per-layer states take {bytes_per_slot} bytes, more than {STATE_MEMORY_SHARE:.0%} of the "
            f"{gib(available)} GiB of {device.type} memory available ({bound}); free memory"
        )
    return min(slots, affordable)


def activation_bytes(model: torch.nn.Module, max_batch_tokens: int, max_requests: int) -> int:
    """Memory one step needs besides the cache: hidden states and MLP activations for every query token, and fp32
    logits for every emitting row (computed from the budgets; no [T, T] mask is ever built)."""
    config = model.config.get_text_config()
    element = torch.empty((), dtype=model.dtype).element_size()
    # Some configs carry the field as None (GPT-Neo: "4 x hidden" by default), others not at all.
    intermediate = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    per_token = (4 * config.hidden_size + 2 * intermediate) * element
    logits = max_requests * config.vocab_size * 4 * 2
    return max_batch_tokens * per_token + logits


def gib(num_bytes: float) -> str:
    """Bytes as GiB with two decimals, for messages."""
    return f"{num_bytes / 2**30:.2f}"


def check_cache_fits(shape: CacheShape, num_blocks: int, page_size: int, device: torch.device) -> None:
    """An explicit `num_blocks` x `page_size` must fit in the memory available now, with room to spare; say so
    before allocating rather than fail in the allocator (or push the machine into swap)."""
    needed = num_blocks * page_size * shape.bytes_per_token
    available, bound = _device_memory(device)
    if needed > MAX_EXPLICIT_CACHE_SHARE * available:
        raise ValueError(
            f"num_blocks={num_blocks} x page_size={page_size} needs {gib(needed)} GiB of KV cache "
            f"({shape.bytes_per_token} bytes per token), but only {gib(available)} GiB of {device.type} memory is "
            f"available ({bound}); lower num_blocks or page_size (or leave num_blocks=None to size it automatically)"
        )


def absolute_position_limit(model: torch.nn.Module) -> int | None:
    """How many positions a model with a learned absolute position table takes (GPT-2's `wpe`, OPT's
    `embed_positions`), or None when positions are relative (RoPE, ALiBi): a request past it would index outside the
    table. Found by module name; a model this misses still fails alone (the step's culprit is isolated)."""
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Embedding) and (leaf == "wpe" or "position" in leaf):
            return module.num_embeddings - int(getattr(module, "offset", 0))
    return None


def plan_num_blocks(
    shape: CacheShape,
    page_size: int,
    device: torch.device,
    max_memory_percent: float,
    reserved_bytes: int,
    max_useful_blocks: int | None = None,
) -> int:
    """How many blocks to allocate when the user left `num_blocks=None`.

    The budget is `max_memory_percent` of the memory that is free once the model is loaded, minus `reserved_bytes`
    (the activations of the largest step, computed from the step budgets). On CPU it is also capped at
    `CPU_CACHE_CAP_BYTES`. `max_useful_blocks` (from workload hints: every request at its longest, all at once, see
    `useful_blocks`) caps it further: more blocks than that would never be used.
    """
    available, bound = _device_memory(device)
    budget = max_memory_percent * max(available - reserved_bytes, 0)
    if device.type != "cuda":
        budget = min(budget, CPU_CACHE_CAP_BYTES)
    block_bytes = shape.bytes_per_token * page_size
    num_blocks = int(budget // block_bytes)
    if max_useful_blocks is not None:
        num_blocks = min(num_blocks, max_useful_blocks)
    if num_blocks < 1:
        raise ValueError(
            f"max_memory_percent={max_memory_percent:g} of the {gib(available)} GiB of {device.type} memory available "
            f"({bound}), less {gib(reserved_bytes)} GiB for the step's activations, is {budget:.0f} bytes: not one "
            f"KV-cache block of {page_size} tokens ({block_bytes} bytes); raise max_memory_percent, set num_blocks, "
            "or free memory"
        )
    return num_blocks


@dataclass(frozen=True)
class HostPoolPlan:
    """The host pool's size, and the cap that decided it when it is smaller than `cpu_offload_space` asked."""

    num_blocks: int
    capped_by: str | None  # None: cpu_offload_space was granted (or None asked for the whole cap)


def plan_num_host_blocks(
    offload_space_gib: float | None, safety_threshold: float, bytes_per_block: int
) -> HostPoolPlan:
    """Host blocks for `cpu_offload_space` GiB, capped at `safety_threshold` of the machine's RAM (as transformers;
    None takes the whole cap) and, unlike transformers, at `safety_threshold` of the memory this process may take
    now (`host_memory`: the RAM available, its cgroup's limit, its address-space limit). The pool is zero-filled at
    start, so a cap on total RAM alone could take memory that other processes hold, and a process under a memory
    limit would be killed, or fail in the allocator, for asking what the machine has."""
    memory = host_memory()
    cap = safety_threshold * min(memory.total, memory.available)
    bound = memory.bound if memory.available < memory.total else "the machine's RAM"
    if offload_space_gib is None:
        return HostPoolPlan(int(cap // bytes_per_block), None)
    wanted = offload_space_gib * GIB
    if wanted <= cap:
        return HostPoolPlan(int(wanted // bytes_per_block), None)
    return HostPoolPlan(
        int(cap // bytes_per_block),
        f"cpu_offload_space_safety_threshold={safety_threshold:g} of {gib(min(memory.total, memory.available))} GiB "
        f"({bound})",
    )


def allocation_error(what: str, option: str, needed: int, device: torch.device, error: BaseException) -> ValueError:
    """The error for an allocation the engine asked for that failed (torch raises RuntimeError, mmap OSError):
    which option sized it, the bytes asked for and the memory this process could take."""
    available, bound = _device_memory(device)
    return ValueError(
        f"could not allocate the {what} ({gib(needed)} GiB, {needed} bytes) on {device.type}: {gib(available)} GiB "
        f"is available to this process ({bound}); lower {option} ({type(error).__name__}: {error})"
    )


def useful_blocks(num_requests: int, longest_request_tokens: int, page_size: int) -> int:
    """Blocks that `num_requests` requests of at most `longest_request_tokens` tokens can hold at once: each
    rounds up to whole pages, plus one block of slack for a request forked or admitted while another finishes."""
    return num_requests * math.ceil(longest_request_tokens / page_size) + 1
