"""Zero-filled tensors whose memory the kernel hands out page by page, when first written: the KV pages
(cbcore/cache.py) and the state pool (cbcore/state_layers.py) are sized for the most a workload may need, and most
of it is often never reached."""

from __future__ import annotations

import math
import mmap

import torch

# Below this many bytes a CPU cache tensor is zeroed by torch as usual (an mmap per small tensor buys nothing).
LAZY_ZERO_MIN_BYTES = 1 << 20


def zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor. On CPU, a large one is an anonymous private mapping: the kernel hands out zero
    pages when they are first touched, so building an engine costs nothing per page the workload never reaches.
    `torch.zeros` writes every byte up front instead: W2's cache (64 requests x 640 tokens, 0.8 GB) took 0.18 s of
    every `generate_batch` to zero, most of it for pages prefix sharing never uses. The tensor keeps the mapping
    alive and unmaps it when it is freed. Zeros (not `torch.empty`'s leftovers) because a freed engine's memory may
    be reused for the next and a kernel must never meet a NaN in a page it masks out.

    The mapping stays on 4 KiB pages. Transparent huge pages (madvise) made the 128-dim fp32 decode at 64 x 2048
    read 26.5 -> 28.2 GB/s (fewer TLB misses: a token's row of 8 kv heads x 128 x fp32 is a 4 KiB page of its own),
    but every huge page is zeroed whole when first touched, and on a VM whose memory the host backs lazily that
    first touch is slow: W2 fp32 in a fresh process (`python -m cbcore bench`, cbcore alone, two rounds of three)
    went 1235-1273 -> 1125-1138 tok/s, its first tokens ~250 ms later, 200 MiB more resident."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < LAZY_ZERO_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)
