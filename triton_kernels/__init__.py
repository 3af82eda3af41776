"""cbcore's Triton kernels, installed as `cbcore.triton_kernels` (never as a top-level `triton_kernels`: that name
belongs to other projects, Triton ships one). See docs/design.md, "Kernels and their dispatch".

- `prefill.prefill_attention`: packed (varlen) causal prefill attention over the paged KV cache, with GQA and
  sliding windows; the CUDA path behind `cbcore.ops.prefill_attention`.

Importing this package never needs a GPU, nor Triton itself: without Triton, `TRITON_AVAILABLE` is False and the
kernels raise a clear error when called.
"""

from .prefill import TRITON_AVAILABLE, PrefillTiles, prefill_attention

__all__ = ["TRITON_AVAILABLE", "PrefillTiles", "prefill_attention"]
