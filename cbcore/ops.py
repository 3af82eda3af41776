"""One Python face per kernel (DESIGN.md §5). Today each op runs its plain-torch reference; the C++/CUDA/Triton
kernels of the kernels issue plug in behind the same functions, chosen by device.

Shapes (every implementation takes exactly these flat tensors, nothing else):
    k_cache, v_cache: [num_blocks, page_size, num_kv_heads, head_dim], one pair per layer
    block_table:      [batch, max_blocks] int, the physical blocks of each request in token order (padding: any
                      valid id; entries past a request's length are never read)
    slot_mapping:     [num_tokens] int64, block * page_size + offset of each new token's K/V
    decode:  q [batch, heads, head_dim], seq_lens [batch] (keys per request, the new token included)
    prefill: q [num_tokens, heads, head_dim] packed, cu_seqlens_q [batch + 1], seq_lens_k [batch]; request i's queries
             are the *last* q_len_i of its seq_lens_k[i] keys (bottom-right aligned causal mask).
A sliding window w lets query position p see key positions k with p - w < k <= p (transformers' convention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cache_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new K/V rows `[num_tokens, kv_heads, head_dim]` into their page slots."""
    cache_write_reference(k, v, k_cache, v_cache, slot_mapping)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per request against that request's pages. Returns `[batch, heads, head_dim]`."""
    return decode_attention_reference(q, k_cache, v_cache, block_table, seq_lens, scale, sliding_window)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Packed causal attention: each request's new queries over its cached prefix plus its new keys (already
    written to the pages). Returns `[num_tokens, heads, head_dim]`."""
    return prefill_attention_reference(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, sliding_window)


# ----------------------------------------------------------------------------------------------------------------------
# Plain-torch references: the specification every kernel is tested against. Clarity over speed.
# ----------------------------------------------------------------------------------------------------------------------


def cache_write_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """index_copy into the flattened `[num_blocks * page_size, kv_heads, head_dim]` view of the pages."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_pages(cache: torch.Tensor, blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` token rows stored in `blocks` (in order): `[num_tokens, kv_heads, head_dim]`."""
    page_size = cache.shape[1]
    num_blocks = -(-num_tokens // page_size)
    pages = cache.index_select(0, blocks[:num_blocks].long())
    return pages.reshape(-1, cache.shape[2], cache.shape[3])[:num_tokens]


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Gather every request's pages (padded to the longest), mask past its length and outside its window, softmax."""
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // page_size)
    table = block_table[:, :num_blocks].long()
    keys = k_cache[table].reshape(batch, num_blocks * page_size, num_kv_heads, head_dim).float()
    values = v_cache[table].reshape(batch, num_blocks * page_size, num_kv_heads, head_dim).float()
    query = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,bskd->bkgs", query, keys) * scale
    positions = torch.arange(num_blocks * page_size, device=q.device)
    lens = seq_lens.long().view(batch, 1)
    visible = positions.view(1, -1) < lens
    if sliding_window is not None:
        # The query sits at position len - 1 and sees keys k with (len - 1) - window < k.
        visible &= positions.view(1, -1) > lens - 1 - sliding_window
    scores = scores.masked_fill(~visible.view(batch, 1, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgs,bskd->bkgd", probs, values)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Per request: gather its keys from the pages and run SDPA with a bottom-right aligned causal (and window) mask.

    The mask is per request, `[q_len, k_len]`; no mask spanning the whole packed batch is ever built.
    """
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    k_lens = seq_lens_k.tolist()
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    for i, k_len in enumerate(k_lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        keys = gather_pages(k_cache, block_table[i], k_len)
        values = gather_pages(v_cache, block_table[i], k_len)
        q_pos = torch.arange(k_len - q_len, k_len, device=q.device).view(-1, 1)
        k_pos = torch.arange(k_len, device=q.device).view(1, -1)
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        attn = F.scaled_dot_product_attention(
            q[q_start:q_end].transpose(0, 1).unsqueeze(0),
            keys.to(q.dtype).transpose(0, 1).unsqueeze(0),
            values.to(q.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[q_start:q_end] = attn[0].transpose(0, 1)
    return out
