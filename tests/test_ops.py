"""The plain-torch reference ops against dense attention on contiguous K/V: the references are the specification the
kernels of a later issue are tested against, so they are checked here first (pages scattered in random block order,
ragged lengths, lengths crossing page boundaries, GQA, sliding windows)."""

from __future__ import annotations

import pytest
import torch

from cbcore import ops


@pytest.fixture(autouse=True)
def _references_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the references themselves; the kernels are checked against them elsewhere."""
    monkeypatch.setenv("CBCORE_KERNELS", "reference")


def dense_attention(q, k, v, scale, window):
    """q [Lq, H, D] are the last Lq positions of k/v [Lk, KVH, D]; causal (bottom-right) and optional window."""
    lq, heads, _ = q.shape
    lk, kv_heads, _ = k.shape
    group = heads // kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(lk - lq, lk).view(-1, 1)
    k_pos = torch.arange(lk).view(1, -1)
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


def scatter_into_pages(seqs_k, seqs_v, page_size, kv_heads, head_dim, generator):
    """Write each sequence's K/V through `cache_write` into randomly chosen blocks; return caches and block tables."""
    blocks_per_seq = [-(-len(k) // page_size) for k in seqs_k]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    k_cache = torch.zeros(num_blocks, page_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    tables = []
    for k, v, count in zip(seqs_k, seqs_v, blocks_per_seq):
        blocks = [order.pop() for _ in range(count)]
        tables.append(blocks)
        positions = torch.arange(len(k))
        slots = torch.tensor(blocks)[positions // page_size] * page_size + positions % page_size
        ops.cache_write(k, v, k_cache, v_cache, slots)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, table


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_reference_prefill_and_decode_match_dense_attention(page_size, heads, kv_heads, window) -> None:
    generator = torch.Generator().manual_seed(page_size * 100 + heads + kv_heads)
    head_dim = 16
    k_lens = [1, page_size, page_size + 1, 3 * page_size - 1, 37]
    q_lens = [1, 3, page_size + 1, 2, 37]  # includes a whole prompt (q_len == k_len) and single tokens
    seqs_k = [torch.randn(n, kv_heads, head_dim, generator=generator) for n in k_lens]
    seqs_v = [torch.randn(n, kv_heads, head_dim, generator=generator) for n in k_lens]
    k_cache, v_cache, table = scatter_into_pages(seqs_k, seqs_v, page_size, kv_heads, head_dim, generator)
    scale = head_dim**-0.5

    queries = [torch.randn(n, heads, head_dim, generator=generator) for n in q_lens]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    out = ops.prefill_attention(torch.cat(queries), k_cache, v_cache, table, cu,
                                torch.tensor(k_lens, dtype=torch.int32), scale, window)
    for i, q in enumerate(queries):
        want = dense_attention(q, seqs_k[i], seqs_v[i], scale, window)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]].double(), want, atol=1e-5, rtol=1e-5)

    decode_q = torch.randn(len(k_lens), heads, head_dim, generator=generator)
    out = ops.decode_attention(decode_q, k_cache, v_cache, table, torch.tensor(k_lens, dtype=torch.int32), scale, window)
    for i in range(len(k_lens)):
        want = dense_attention(decode_q[i : i + 1], seqs_k[i], seqs_v[i], scale, window)
        torch.testing.assert_close(out[i : i + 1].double(), want, atol=1e-5, rtol=1e-5)


def test_cache_write_puts_each_row_in_its_slot() -> None:
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(5, 2, 8)
    v = torch.randn(5, 2, 8)
    slots = torch.tensor([11, 0, 5, 4, 7])
    ops.cache_write(k, v, k_cache, v_cache, slots)
    for row, slot in enumerate(slots.tolist()):
        torch.testing.assert_close(k_cache[slot // 4, slot % 4], k[row])
        torch.testing.assert_close(v_cache[slot // 4, slot % 4], v[row])
    assert int((k_cache.abs().sum(dim=(2, 3)) > 0).sum()) == 5

