"""Plain-torch references of cbcore's kernels: the specification every kernel is tested against (shapes and
attention features: see cbcore/ops/__init__.py). Clarity over speed."""

from __future__ import annotations

import torch


def cache_write_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """index_copy into the flattened `[num_blocks * page_size, kv_heads, head_dim]` view of the pages (V's head dim
    may differ from K's)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_pages(cache: torch.Tensor, blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` token rows stored in `blocks` (in order): `[num_tokens, kv_heads, head_dim]`."""
    page_size = cache.shape[1]
    num_blocks = -(-num_tokens // page_size)
    pages = cache.index_select(0, blocks[:num_blocks].long())
    return pages.reshape(-1, cache.shape[2], cache.shape[3])[:num_tokens]


def softmax_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention every reference computes, in fp32 (fp64 for fp64 inputs), grouped by kv head.

    query `[B, kv_heads, group, Lq, D]`, keys/values `[B, Lk, kv_heads, D]`, visible `[B, Lq, Lk]` (bool); sinks
    `[kv_heads * group]`. scores = q . k * scale; soft-capped; masked; the sink logit of each head joins the softmax as
    one more column and is dropped after it (GPT-OSS's eager formula). Returns `[B, kv_heads, group, Lq, D]`.
    """
    dtype = torch.promote_types(query.dtype, torch.float32)
    scores = torch.einsum("bkgqd,bskd->bkgqs", query.to(dtype), keys.to(dtype)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    if sinks is not None:
        batch, kv_heads, group, q_len, _ = scores.shape
        sink = sinks.to(dtype).view(1, kv_heads, group, 1, 1).expand(batch, kv_heads, group, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bkgqs,bskd->bkgqd", probs, values.to(dtype))


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather every request's pages (padded to the longest), mask past its length and outside its window, softmax."""
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // page_size)
    table = block_table[:, :num_blocks].long()
    keys = k_cache[table].reshape(batch, num_blocks * page_size, num_kv_heads, k_cache.shape[3])
    values = v_cache[table].reshape(batch, num_blocks * page_size, num_kv_heads, v_cache.shape[3])
    query = q.reshape(batch, num_kv_heads, group, 1, head_dim)
    positions = torch.arange(num_blocks * page_size, device=q.device)
    lens = seq_lens.long().view(batch, 1).to(q.device)
    visible = positions.view(1, -1) < lens
    if sliding_window is not None:
        # The query sits at position len - 1 and sees keys k with (len - 1) - window < k.
        visible &= positions.view(1, -1) > lens - 1 - sliding_window
    out = softmax_attention(query, keys, values, visible.view(batch, 1, -1), scale, softcap, sinks)
    return out.reshape(batch, num_heads, v_cache.shape[3]).to(q.dtype)


def prefill_attention_reference(
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
) -> torch.Tensor:
    """Per request: gather its keys from the pages and attend with a bottom-right aligned causal (and window) mask.

    The mask is per request, `[q_len, k_len]`; no mask spanning the whole packed batch is ever built.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, v_head_dim = k_cache.shape[2], v_cache.shape[3]
    group = num_heads // num_kv_heads
    out = q.new_empty(num_tokens, num_heads, v_head_dim)
    starts = cu_seqlens_q.tolist()
    k_lens = seq_lens_k.tolist()
    for i, k_len in enumerate(k_lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        keys = gather_pages(k_cache, block_table[i], k_len)
        values = gather_pages(v_cache, block_table[i], k_len)
        q_pos = torch.arange(k_len - q_len, k_len, device=q.device).view(-1, 1)
        k_pos = torch.arange(k_len, device=q.device).view(1, -1)
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        query = q[q_start:q_end].reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).unsqueeze(0)
        attn = softmax_attention(query, keys.unsqueeze(0), values.unsqueeze(0), mask.unsqueeze(0), scale, softcap,
                                 sinks)
        out[q_start:q_end] = attn[0].permute(2, 0, 1, 3).reshape(q_len, num_heads, v_head_dim).to(q.dtype)
    return out


def _partial_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one key range, as (normalised output, log-sum-exp of the scores) so ranges can be merged.

    query `[M, kv_heads, group, D]`, keys/values `[M, Lk, kv_heads, D]`, visible `[M, Lk]`. A row that sees no key gets
    output 0 and log-sum-exp -inf (it weighs nothing in the merge)."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    scores = torch.einsum("mkgd,mskd->mkgs", query.to(dtype), keys.to(dtype)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    return torch.einsum("mkgs,mskd->mkgd", probs, values.to(dtype)), lse


def cascade_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    groups: list[tuple[list[int], int]],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention computed the cascade way, equal to `decode_attention_reference` (the tests hold the two
    together): each group `(members, prefix)` attends to its shared keys `[0, prefix)` once, gathered through its first
    member's block table (the members' tables hold the same blocks there), as one matrix over all the members' queries;
    every request then attends to its own keys (after the prefix, inside its window); the parts are merged by their
    log-sum-exp, the sink logit joining the denominator once. A member's window must start at key 0 (the plan groups
    no other)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, v_head_dim = k_cache.shape[2], v_cache.shape[3]
    group = num_heads // num_kv_heads
    dtype = torch.promote_types(q.dtype, torch.float32)
    lens = [int(n) for n in seq_lens]
    prefix = [0] * batch
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(batch)]
    for members, shared in groups:
        for b in members:
            assert sliding_window is None or lens[b] <= sliding_window, "a member's window cuts into the prefix"
            prefix[b] = shared
        keys = gather_pages(k_cache, block_table[members[0]], shared)
        values = gather_pages(v_cache, block_table[members[0]], shared)
        query = q[members].reshape(len(members), num_kv_heads, group, head_dim)
        visible = torch.ones(len(members), shared, dtype=torch.bool, device=q.device)
        out, lse = _partial_attention(query, keys.expand(len(members), *keys.shape),
                                      values.expand(len(members), *values.shape), visible, scale, softcap)
        for i, b in enumerate(members):
            parts[b].append((out[i], lse[i]))
    result = q.new_empty(batch, num_heads, v_head_dim)
    for b in range(batch):
        n = lens[b]
        begin = max(prefix[b], 0 if sliding_window is None else max(0, n - sliding_window))
        keys = gather_pages(k_cache, block_table[b], n)[begin:]
        values = gather_pages(v_cache, block_table[b], n)[begin:]
        query = q[b].reshape(1, num_kv_heads, group, head_dim)
        visible = torch.ones(1, n - begin, dtype=torch.bool, device=q.device)
        out, lse = _partial_attention(query, keys[None], values[None], visible, scale, softcap)
        parts[b].append((out[0], lse[0]))
        lses = torch.stack([lse for _, lse in parts[b]])  # [parts, kv_heads, group]
        if sinks is not None:
            lses = torch.cat([lses, sinks.to(dtype).view(1, num_kv_heads, group)])
        total = torch.logsumexp(lses, dim=0)
        merged = sum(torch.exp(lse - total)[..., None] * out for out, lse in parts[b])
        result[b] = merged.reshape(num_heads, v_head_dim).to(q.dtype)
    return result
