"""Packed (varlen) causal prefill attention over the paged KV cache, in Triton.

The contract is `cbcore.ops.prefill_attention_reference` (the plain-torch specification): queries of all requests
packed into one `[num_tokens, heads, head_dim]` tensor; request i's queries are the *last* q_len_i of its
seq_lens_k[i] keys (bottom-right aligned causal mask: query at key position p sees keys k <= p; with a sliding window
w, keys p - w < k <= p). Keys and values, the cached prefix and the new tokens alike (the caller has already written
the new ones), are read from the pages through the block table: token t of request i is at
`(block_table[i, t // page_size], t % page_size)`.

Kernel design (flash-attention 2 style, one pass, online softmax in base 2, fp32 accumulation):

- A program owns one *query tile* of one request and one *kv head*. Its BLOCK_M rows are BLOCK_Q query positions x
  GROUP query heads (GROUP = heads // kv_heads): row r is query position `r // GROUP`, head `kv_head * GROUP +
  r % GROUP`. All query heads that share a kv head are handled together, so each K/V tile is loaded once for the whole
  group, and short queries (decode-like chunks) still fill the rows of the tensor-core tile.
- Which request a program serves is found *in the kernel* by a binary search over cu_seqlens_q: request i owns the
  tile ids `[cu_seqlens_q[i] // BLOCK_Q + i, ...)`, a non-decreasing sequence that leaves room for
  ceil(q_len_i / BLOCK_Q) tiles per request. The grid is therefore sized from shapes alone (`num_tokens // BLOCK_Q +
  batch` tiles, a bound on the real count), so a call costs no device-to-host sync and no host-side metadata
  launches, and is CUDA-graph friendly; the few spare programs return at once. (The alternative, a per-program
  mapping tensor built with torch ops on the host side, costs several small launches per layer per step, or a plan
  object threaded through the attention call; the search costs log2(batch) scalar loads per program.)
- The key loop walks BLOCK_N keys at a time over the keys the tile can see: from the window start of its first
  query (0 without a window) to its last query's position. Key tiles wholly outside every row's causal/window range
  are never visited. Tiles that every row sees in full skip the mask; only the boundary tiles (diagonal, window
  edge, the request's end) apply it.
- The physical page of every key is looked up per key position (`block_table[i, pos // page_size]`), so BLOCK_N is
  independent of the page size: a key tile may span several pages (small pages) or part of one (large pages). Any
  page size >= 1 works.
- head_dim need not be a power of two: the tile is padded to the next power of two (at least 16) with masked loads.
- Soft-capping (HAS_SOFTCAP) bends every score, in the log2 domain, before the mask: with c2 = softcap * log2(e),
  s2 = c2 * tanh(s2 / c2) is exactly softcap * tanh(s / softcap) scaled by log2(e). tanh is written with exp2
  (tanh y = 1 - 2 / (1 + 2^(2y log2 e))), which the compiler and the interpreter both have.
- Sinks (HAS_SINKS) start each row's online softmax as one key of logit `sink` and no value: m = sink * log2(e),
  l = 1, acc = 0. Every later tile rescales them like any other key's share.
- V may have its own head dim (V_HEAD_DIM, padded to BLOCK_DV), as in multi-head latent attention; the output has it.
- fp32 inputs use IEEE fp32 dot products (not TF32) so fp32 results match the reference closely; fp16/bf16 inputs use
  tensor cores with fp32 accumulation (P is rounded to the input dtype before the P @ V product, as in flash-attn).

Triton is imported, and the kernel jitted, on the first call, never on import: importing this module needs neither
a GPU nor Triton. Triton fixes compiled-vs-interpreted (`TRITON_INTERPRET=1`) for its own library functions
(`tl.zeros`, `tl.sum`, ...) when it is first imported, and for a kernel when it is decorated; a process therefore
runs in one mode, chosen by TRITON_INTERPRET when Triton is first imported (often early and indirectly:
torch._dynamo imports it, and transformers' model classes import torch._dynamo). Calling when TRITON_INTERPRET says
otherwise raises a clear error rather than failing deep inside Triton.
"""

# String annotations (PEP 563) keep `tl.constexpr` unevaluated, so this module imports without Triton; Triton 3.x
# reads "tl.constexpr" strings as constexpr parameters.
from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple

import torch

# Without Triton (a CPU-only install) cbcore still imports; calling the kernel then raises.
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
# Bound by _import_triton() on the first call (see the module docstring for why not on import). The kernel body
# below reads `tl` from these module globals, as Triton's JIT and interpreter both do.
triton = None
tl = None

__all__ = ["TRITON_AVAILABLE", "PrefillTiles", "prefill_attention", "choose_tiles"]

LOG2_E = 1.4426950408889634


class PrefillTiles(NamedTuple):
    """Launch shape: BLOCK_M rows (query positions x group heads) by BLOCK_N keys per step; Triton's warps/stages."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


def choose_tiles(num_tokens: int, num_requests: int, group: int, head_dim: int, dtype: torch.dtype,
                 interpret: bool = False) -> PrefillTiles:
    """Tile sizes from shapes only (no device sync). Starting points, to be tuned on a GPU with
    bench/test_bench_triton_prefill.py.

    BLOCK_M (a power of two >= 16 for tl.dot) shrinks when requests bring few query rows (short chunks, decode-like
    queries), so a tile is not mostly padding; it always holds at least one query position's whole head group.
    """
    block_d = padded_head_dim(head_dim)
    rows_per_request = -(-num_tokens // max(num_requests, 1)) * group
    wide = 64 if dtype == torch.float32 or block_d > 128 else 128
    block_m = max(16, _next_power_of_2(group), min(wide, _next_power_of_2(rows_per_request)))
    if interpret:
        # The interpreter runs programs one after another with numpy; moderate tiles keep the tests quick.
        return PrefillTiles(block_m=max(16, _next_power_of_2(group), min(32, block_m)), block_n=32)
    block_n = 32 if dtype == torch.float32 or block_d > 128 else 64
    num_warps = 8 if block_m >= 128 and block_d >= 128 else 4
    return PrefillTiles(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=2)


def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernel's tiles use: the next power of two, at least 16 (tl.dot's smallest K)."""
    return max(16, _next_power_of_2(head_dim))


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _import_triton() -> None:
    global triton, tl
    if tl is None:
        import triton as triton_module
        import triton.language as language_module

        triton, tl = triton_module, language_module


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its interpreter in this process (imports Triton if needed).

    Raises RuntimeError when TRITON_INTERPRET now says otherwise than when Triton was first imported: Triton's own
    library functions were then built for the other mode, and kernels would fail inside Triton.
    """
    _import_triton()
    wanted = bool(triton.knobs.runtime.interpret)
    library_interpreted = not isinstance(tl.zeros, triton.JITFunction)
    if wanted != library_interpreted:
        raise RuntimeError(
            f"TRITON_INTERPRET is {'on' if wanted else 'off'} now but was {'on' if library_interpreted else 'off'} "
            "when triton was first imported (Triton fixes the mode of its own library then; torch._dynamo and "
            "transformers' models import it). Set TRITON_INTERPRET=1 before anything imports triton, for example in "
            "the environment of the process, or run the interpreted code in a subprocess."
        )
    return wanted


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    *,
    tiles: PrefillTiles | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new queries over its cached prefix plus its new keys, read from the pages.

    Args:
        q: `[num_tokens, heads, head_dim]`, the queries of all requests packed in request order (fp16/bf16/fp32).
        k_cache, v_cache: `[num_blocks, page_size, kv_heads, head_dim]`; heads must be a multiple of kv_heads
            (GQA/MQA). Normally q's dtype; another one is converted to q's on load, as the reference does. v_cache's
            head dim may differ from k_cache's (multi-head latent attention).
        block_table: `[batch, max_blocks]` int32/int64, each request's physical blocks in token order; entries past a
            request's length are never read.
        cu_seqlens_q: `[batch + 1]` int32/int64, query offsets into q (cu_seqlens_q[-1] == num_tokens).
        seq_lens_k: `[batch]` int32/int64, keys per request, its new tokens included (>= its query count).
        scale: softmax scale.
        sliding_window: w: a query at position p sees keys p - w < k <= p (transformers' convention); None: all k <= p.
        softcap: scores become softcap * tanh(score / softcap) before the mask (Gemma-2); None: off.
        sinks: `[heads]` sink logits (GPT-OSS's s_aux) joining each softmax's denominator; None: off.
        tiles: launch shape override (benchmarks, tests); by default `choose_tiles`.

    Returns `[num_tokens, heads, v_head_dim]` in q's dtype, like `cbcore.ops.prefill_attention_reference`. Only shapes
    are checked here: checking the values would cost a device sync on every call of every layer.
    """
    _check_inputs(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, sliding_window, softcap, sinks)
    num_tokens, num_heads, head_dim = q.shape
    v_head_dim = v_cache.shape[3]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_requests = seq_lens_k.shape[0]
    group = num_heads // num_kv_heads
    if tiles is not None:
        _check_tiles(tiles, group)
    interpret = interpreter_enabled()
    if q.device.type != "cuda" and not interpret:
        raise RuntimeError(
            f"triton prefill_attention got tensors on {q.device}; the Triton kernel runs on CUDA devices. On the CPU "
            "use cbcore.ops.prefill_attention (C++ kernel or reference), or run the process with TRITON_INTERPRET=1 "
            "set before triton is first imported, to use Triton's interpreter (slow: for tests)."
        )

    out = torch.empty((num_tokens, num_heads, v_head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_requests == 0:
        return out
    if tiles is None:
        tiles = choose_tiles(num_tokens, num_requests, group, max(head_dim, v_head_dim), q.dtype, interpret)
    block_q = tiles.block_m // group
    # Request i's tiles start at id cu_seqlens_q[i] // block_q + i, so every id is below num_tokens // block_q + batch.
    grid = (num_tokens // block_q + num_requests, num_kv_heads)
    kernel = _jitted_kernel(interpret)
    if sinks is not None:
        sinks = sinks.detach().to(device=q.device, dtype=torch.float32).contiguous()
    kernel[grid](
        q, k_cache, v_cache, out, block_table, cu_seqlens_q, seq_lens_k,
        sinks if sinks is not None else out,  # a pointer the kernel never reads when HAS_SINKS is off
        float(scale) * LOG2_E, int(sliding_window or 0), float(softcap or 1.0) * LOG2_E, num_requests,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), block_table.stride(0),
        GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
        V_HEAD_DIM=v_head_dim, BLOCK_DV=padded_head_dim(v_head_dim),
        BLOCK_M=tiles.block_m, BLOCK_Q=block_q, BLOCK_N=tiles.block_n,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton's interpreter stores bf16 as raw uint16 and its tl.dot multiplies the bit patterns (no bf16
        # arithmetic in the interpreter: triton-lang/triton#11584); there the bf16 operands go through fp32, with P
        # still rounded to bf16 first. Compiled kernels never take this path.
        BF16_AS_FP32=interpret and q.dtype == torch.bfloat16,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def _check_inputs(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, sliding_window, softcap=None,
                  sinks=None) -> None:
    """Shape, dtype and device checks (host-side metadata only: no sync)."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("triton prefill_attention needs the `triton` package; use cbcore.ops.prefill_attention, "
                           "which falls back to the C++ CPU kernel or the reference")
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"expected q [num_tokens, heads, head_dim] and k_cache [num_blocks, page_size, kv_heads, "
                         f"head_dim]; got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if v_cache.dim() != 4 or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in more than the "
                         "head dim")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but the cache has {k_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"heads ({num_heads}) must be a multiple of kv_heads ({num_kv_heads})")
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")
    batch = seq_lens_k.shape[0]
    if seq_lens_k.dim() != 1 or cu_seqlens_q.shape != (batch + 1,) or block_table.dim() != 2 \
            or block_table.shape[0] != batch:
        raise ValueError(f"expected seq_lens_k [batch], cu_seqlens_q [batch + 1], block_table [batch, max_blocks]; "
                         f"got {tuple(seq_lens_k.shape)}, {tuple(cu_seqlens_q.shape)}, {tuple(block_table.shape)}")
    for name, tensor in (("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens_k", seq_lens_k)):
        if tensor.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {tensor.dtype}")
    devices = {t.device for t in (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(str(d) for d in devices)}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if softcap is not None and not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be None or a positive finite number, got {softcap}")
    if sinks is not None and (sinks.shape != (num_heads,) or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be a floating-point [heads={num_heads}] tensor, got {tuple(sinks.shape)} "
                         f"{sinks.dtype}")


def _check_tiles(tiles: PrefillTiles, group: int) -> None:
    for name in ("block_m", "block_n"):
        value = getattr(tiles, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"tiles.{name} must be a power of two >= 16 (tl.dot's smallest tile), got {value}")
    if tiles.block_m < group:
        raise ValueError(f"tiles.block_m ({tiles.block_m}) must hold a whole group of {group} query heads")


@functools.cache
def _jitted_kernel(interpret: bool):
    """The kernel, jitted for the process's mode. `triton.jit` reads TRITON_INTERPRET itself when it decorates;
    `interpret` (checked against it just before) is the cache key, so a kernel of one mode is never reused in the
    other."""
    del interpret
    return triton.jit(_prefill_attention_kernel, do_not_specialize=["window", "softcap_log2", "num_requests"])


def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_table_ptr, cu_seqlens_q_ptr, seq_lens_k_ptr,
    sinks_ptr,  # [heads] fp32; read only when HAS_SINKS
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    window,  # read only when HAS_WINDOW
    softcap_log2,  # softcap * log2(e); read only when HAS_SOFTCAP
    num_requests,
    stride_q_token, stride_q_head, stride_q_dim,
    stride_k_block, stride_k_slot, stride_k_head, stride_k_dim,
    stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
    stride_o_token, stride_o_head, stride_o_dim,
    stride_table,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BF16_AS_FP32: tl.constexpr,  # interpreter only: it has no bf16 arithmetic (see prefill_attention)
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The request owning this tile: the last i with cu_seqlens_q[i] // BLOCK_Q + i <= tile_id (binary search).
    lo = 0
    hi = num_requests
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    request = lo - 1
    q_start = tl.load(cu_seqlens_q_ptr + request)
    q_len = tl.load(cu_seqlens_q_ptr + request + 1) - q_start
    first_q = (tile_id - (q_start // BLOCK_Q + request)) * BLOCK_Q  # this tile's first query, counted in the request
    if first_q >= q_len:
        return  # a spare program: the grid is an upper bound computed from shapes alone
    k_len = tl.load(seq_lens_k_ptr + request)
    last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1
    offset = k_len - q_len  # query j of the request sits at key position offset + j (bottom-right aligned)
    first_pos = offset + first_q
    last_pos = offset + last_q

    rows = tl.arange(0, BLOCK_M)
    row_q = first_q + rows // GROUP
    row_head = kv_head * GROUP + rows % GROUP
    row_valid = row_q <= last_q
    # Padding rows take the tile's last position, so every row sees at least one key (no 0/0 at the end).
    row_pos = offset + tl.minimum(row_q, last_q)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    v_dims = tl.arange(0, BLOCK_DV)
    v_dim_valid = v_dims < V_HEAD_DIM

    q_rows = (q_start + row_q).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_token + row_head[:, None] * stride_q_head + dims[None, :] * stride_q_dim,
        mask=row_valid[:, None] & dim_valid[None, :], other=0.0,
    )
    if BF16_AS_FP32:
        q = q.to(tl.float32)

    # Keys any row can see: [key_start, last_pos]. Keys every row sees: [full_start, first_pos].
    if HAS_WINDOW:
        key_start = tl.maximum(first_pos - window + 1, 0)
        full_start = tl.maximum(last_pos - window + 1, 0)
    else:
        key_start = 0
        full_start = 0
    tile_lo = key_start // BLOCK_N
    tile_hi = last_pos // BLOCK_N + 1
    full_lo = (full_start + BLOCK_N - 1) // BLOCK_N  # first key tile inside every row's window
    full_hi = (first_pos + 1) // BLOCK_N  # first key tile reaching past the tile's first query

    # Online softmax state; m starts finite so a row that sees no key of a boundary tile gives exp2(-inf) = 0, not NaN.
    # A sink is one more key, of logit `sink` and no value: the state starts from it (m = sink, l = 2^0 = 1).
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + row_head).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    table_row = block_table_ptr + request.to(tl.int64) * stride_table
    for key_tile in range(tile_lo, tile_hi):
        key_pos = key_tile * BLOCK_N + cols
        key_valid = key_pos < k_len  # the request's last tile may run past its keys (and past its block table row)
        block = tl.load(table_row + key_pos // PAGE_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = key_pos % PAGE_SIZE
        k_offsets = block * stride_k_block + slot * stride_k_slot + kv_head * stride_k_head
        k = tl.load(  # [BLOCK_D, BLOCK_N]
            k_cache_ptr + k_offsets[None, :] + dims[:, None] * stride_k_dim,
            mask=key_valid[None, :] & dim_valid[:, None], other=0.0,
        )
        k = k.to(q_ptr.dtype.element_ty)  # no-op unless the cache's dtype differs from q's
        if BF16_AS_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if HAS_SOFTCAP:
            # softcap * tanh(s / softcap), in the log2 domain; tanh(y) = 1 - 2 / (1 + e^(2y)) saturates cleanly.
            capped = 2.0 * 1.4426950408889634 * (scores / softcap_log2)
            scores = softcap_log2 * (1.0 - 2.0 / (1.0 + tl.exp2(capped)))
        if (key_tile < full_lo) | (key_tile >= full_hi):
            visible = key_pos[None, :] <= row_pos[:, None]
            if HAS_WINDOW:
                visible = visible & (key_pos[None, :] > row_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_offsets = block * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
        v = tl.load(  # [BLOCK_N, BLOCK_DV]
            v_cache_ptr + v_offsets[:, None] + v_dims[None, :] * stride_v_dim,
            mask=key_valid[:, None] & v_dim_valid[None, :], other=0.0,
        )
        v = v.to(q_ptr.dtype.element_ty)
        p = p.to(v.dtype)  # rounded to the input dtype for the tensor-core product, as flash-attn does
        if BF16_AS_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None]
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_o_token + row_head[:, None] * stride_o_head + v_dims[None, :] * stride_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & v_dim_valid[None, :],
    )
