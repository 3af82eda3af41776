"""How big the engine is: the step budgets and the number of cache blocks, from the config, the workload hints and
the memory available (transformers infers its budgets from GPU memory; on a CPU cbcore bounds the cache, since it
shares RAM with everything else)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import psutil
import torch
from transformers.generation.continuous_batching.utils import WorkloadHints

from ..cache_shape import CacheShape
from ..config import ContinuousBatchingConfig

# Default step budgets when the config leaves them None (transformers infers them from GPU memory). On a CPU a
# prefill step's linears run faster per token up to about 2048 rows (oneDNN bf16 at K = 512: ~1.0-1.5 TFLOP/s at
# 920 rows, up to 2.2 at 2048), so 2048 gave W1 bf16 +4% and W2 +3% (bf16) / +6% (fp32) tok/s over 1024, W1 fp32
# unchanged; 4096 gained no more (README, "Stop 31"). vLLM's CPU defaults are 4096 (LLM) and 2048 (its server).
DEFAULT_MAX_BATCH_TOKENS = {"cpu": 2048, "cuda": 8192}
FALLBACK_MAX_REQUESTS_PER_BATCH = 1024  # transformers' fallback
# On a CPU the KV cache lives in the same RAM as everything else; never take more than this by default, so a small
# model on a laptop-sized machine cannot push it into swap (transformers takes 60% of free RAM on CPU). 1 GiB holds
# 64 requests of 512 tokens for a 32-layer model with 8 KV heads of 128 in bf16 / 16 layers in fp32; a workload that
# would need more is preempted (swap or recompute) rather than given more RAM, unless `num_blocks` says otherwise.
CPU_CACHE_CAP_BYTES = 2**30
CPU_MAX_MEMORY_PERCENT = 0.6  # transformers' default on CPU; cbcore also caps the bytes (CPU_CACHE_CAP_BYTES)
# An explicit num_blocks may take at most this share of the memory available when the cache is allocated: beyond it
# the allocation would push the machine into swap or fail with a raw allocator error.
MAX_EXPLICIT_CACHE_SHARE = 0.9


@dataclass(frozen=True)
class EngineSizes:
    """The resolved sizes: what the config left None, filled in."""

    num_blocks: int
    max_batch_tokens: int
    max_requests_per_batch: int


def plan_sizes(
    model: torch.nn.Module, shape: CacheShape, cfg: ContinuousBatchingConfig, hints: WorkloadHints | None
) -> EngineSizes:
    """Budgets and block count for `model` on its device. An explicit `num_blocks` that does not fit in the memory
    available is refused here, naming it, rather than failing in the allocator."""
    device = model.device
    max_requests = cfg.max_requests_per_batch
    if max_requests is None:
        wanted = hints.num_requests if hints is not None and hints.num_requests > 0 else None
        max_requests = min(wanted or FALLBACK_MAX_REQUESTS_PER_BATCH, FALLBACK_MAX_REQUESTS_PER_BATCH)
    max_batch_tokens = cfg.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS.get(device.type, 2048)
    num_blocks = cfg.num_blocks
    if num_blocks is None:
        percent = cfg.max_memory_percent or (CPU_MAX_MEMORY_PERCENT if device.type != "cuda" else 0.9)
        useful = None
        if hints is not None and hints.num_requests > 0 and hints.max_prompt_length > 0:
            longest = hints.max_prompt_length + max(hints.max_generated_length, 1)
            useful = useful_blocks(hints.num_requests, longest, cfg.page_size)
        reserved = activation_bytes(model, max_batch_tokens, max_requests)
        num_blocks = plan_num_blocks(shape, cfg.page_size, device, percent, reserved, useful)
    else:
        check_cache_fits(shape, num_blocks, cfg.page_size, device)
    return EngineSizes(num_blocks, max_batch_tokens, min(max_requests, max_batch_tokens))


def activation_bytes(model: torch.nn.Module, max_batch_tokens: int, max_requests: int) -> int:
    """Memory one step needs besides the cache: hidden states and MLP activations for every query token, and fp32
    logits for every emitting row (computed from the budgets; no [T, T] mask is ever built)."""
    config = model.config.get_text_config()
    element = torch.empty((), dtype=model.dtype).element_size()
    intermediate = getattr(config, "intermediate_size", 4 * config.hidden_size)
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
    if device.type == "cuda":
        available, _total = torch.cuda.mem_get_info(device)
    else:
        available = psutil.virtual_memory().available
    if needed > MAX_EXPLICIT_CACHE_SHARE * available:
        raise ValueError(
            f"num_blocks={num_blocks} x page_size={page_size} needs {gib(needed)} GiB of KV cache "
            f"({shape.bytes_per_token} bytes per token), but only {gib(available)} GiB of {device.type} memory is "
            "available; lower num_blocks or page_size (or leave num_blocks=None to size it automatically)"
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
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = max_memory_percent * max(free - reserved_bytes, 0)
    else:
        available = psutil.virtual_memory().available
        budget = min(max_memory_percent * max(available - reserved_bytes, 0), CPU_CACHE_CAP_BYTES)
    num_blocks = int(budget // (shape.bytes_per_token * page_size))
    if max_useful_blocks is not None:
        num_blocks = min(num_blocks, max_useful_blocks)
    if num_blocks < 1:
        raise ValueError(
            f"not enough free memory for a single KV-cache block of {page_size} tokens "
            f"({shape.bytes_per_token * page_size} bytes); set num_blocks explicitly or free memory"
        )
    return num_blocks


def useful_blocks(num_requests: int, longest_request_tokens: int, page_size: int) -> int:
    """Blocks that `num_requests` requests of at most `longest_request_tokens` tokens can hold at once: each
    rounds up to whole pages, plus one block of slack for a request forked or admitted while another finishes."""
    return num_requests * math.ceil(longest_request_tokens / page_size) + 1
