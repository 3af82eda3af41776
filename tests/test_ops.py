"""The plain-torch reference ops against dense attention on contiguous K/V: the references are the specification the
kernels are tested against, so they are checked here first (pages scattered in random block order, ragged lengths,
lengths crossing page boundaries, GQA, sliding windows, soft-capping, attention sinks, a V head dim of its own), and
against transformers' own eager attention of the models that define the features (Gemma-2, GPT-OSS)."""

from __future__ import annotations

import pytest
import torch

from cbcore import ops


@pytest.fixture(autouse=True)
def _references_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the references themselves; the kernels are checked against them elsewhere."""
    monkeypatch.setenv("CBCORE_KERNELS", "reference")


def dense_attention(q, k, v, scale, window, softcap=None, sinks=None):
    """q [Lq, H, D] are the last Lq positions of k/v [Lk, KVH, D]; causal (bottom-right) and optional window; scores
    soft-capped before the mask; sinks [H] as explicit exp terms of the denominator (a second way to write it)."""
    lq, heads, _ = q.shape
    lk, kv_heads, _ = k.shape
    group = heads // kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(lk - lq, lk).view(-1, 1)
    k_pos = torch.arange(lk).view(1, -1)
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = scores.exp()
    denominator = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + sinks.double().exp().view(-1, 1, 1)
    return torch.einsum("hqk,khd->qhd", weights / denominator, v.double())


def scatter_into_pages(seqs_k, seqs_v, page_size, kv_heads, head_dim, generator):
    """Write each sequence's K/V through `cache_write` into randomly chosen blocks; return caches and block tables."""
    blocks_per_seq = [-(-len(k) // page_size) for k in seqs_k]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    k_cache = torch.zeros(num_blocks, page_size, kv_heads, head_dim)
    v_cache = torch.zeros(num_blocks, page_size, kv_heads, seqs_v[0].shape[-1])
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


FEATURES = {  # id -> (softcap, whether to use sinks, V head dim)
    "plain": (None, False, None),
    "softcap": (0.8, False, None),
    "sinks": (None, True, None),
    "softcap+sinks+v_head_dim": (0.8, True, 8),
}


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_reference_prefill_and_decode_match_dense_attention(page_size, heads, kv_heads, window, feature) -> None:
    softcap, with_sinks, v_head_dim = FEATURES[feature]
    generator = torch.Generator().manual_seed(page_size * 100 + heads + kv_heads)
    head_dim = 16
    v_head_dim = v_head_dim or head_dim
    k_lens = [1, page_size, page_size + 1, 3 * page_size - 1, 37]
    q_lens = [1, 3, page_size + 1, 2, 37]  # includes a whole prompt (q_len == k_len) and single tokens
    seqs_k = [torch.randn(n, kv_heads, head_dim, generator=generator) for n in k_lens]
    seqs_v = [torch.randn(n, kv_heads, v_head_dim, generator=generator) for n in k_lens]
    k_cache, v_cache, table = scatter_into_pages(seqs_k, seqs_v, page_size, kv_heads, head_dim, generator)
    scale = head_dim**-0.5
    sinks = torch.randn(heads, generator=generator) * 2 if with_sinks else None

    queries = [torch.randn(n, heads, head_dim, generator=generator) for n in q_lens]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    out = ops.prefill_attention(torch.cat(queries), k_cache, v_cache, table, cu,
                                torch.tensor(k_lens, dtype=torch.int32), scale, window, softcap, sinks)
    assert out.shape == (sum(q_lens), heads, v_head_dim)
    for i, q in enumerate(queries):
        want = dense_attention(q, seqs_k[i], seqs_v[i], scale, window, softcap, sinks)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]].double(), want, atol=1e-5, rtol=1e-5)

    decode_q = torch.randn(len(k_lens), heads, head_dim, generator=generator)
    out = ops.decode_attention(decode_q, k_cache, v_cache, table, torch.tensor(k_lens, dtype=torch.int32), scale,
                               window, softcap, sinks)
    for i in range(len(k_lens)):
        want = dense_attention(decode_q[i : i + 1], seqs_k[i], seqs_v[i], scale, window, softcap, sinks)
        torch.testing.assert_close(out[i : i + 1].double(), want, atol=1e-5, rtol=1e-5)


def one_prompt_in_pages(q_len, heads, kv_heads, head_dim, page_size=4, seed=0):
    """A single prompt's q/k/v in transformers' layout ([1, heads, T, d]) and the same K/V written into pages."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, heads, q_len, head_dim, generator=generator)
    key = torch.randn(1, kv_heads, q_len, head_dim, generator=generator)
    value = torch.randn(1, kv_heads, q_len, head_dim, generator=generator)
    k_cache, v_cache, table = scatter_into_pages([key[0].transpose(0, 1)], [value[0].transpose(0, 1)], page_size,
                                                 kv_heads, head_dim, generator)
    return query, key, value, k_cache, v_cache, table


def causal_float_mask(q_len, window=None):
    """transformers' eager mask for one prompt: 0 where visible, the dtype's minimum elsewhere."""
    pos = torch.arange(q_len)
    visible = pos.view(1, -1) <= pos.view(-1, 1)
    if window is not None:
        visible &= pos.view(1, -1) > pos.view(-1, 1) - window
    return torch.zeros(1, 1, q_len, q_len).masked_fill(~visible, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("window", [None, 4])
def test_reference_softcap_equals_gemma2_eager_attention(window) -> None:
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    heads, kv_heads, head_dim, q_len, softcap, scale = 4, 2, 16, 11, 0.5, 0.3
    query, key, value, k_cache, v_cache, table = one_prompt_in_pages(q_len, heads, kv_heads, head_dim)
    module = torch.nn.Module()
    module.num_key_value_groups, module.head_dim, module.training = heads // kv_heads, head_dim, False
    want, _ = eager_attention_forward(module, query, key, value, causal_float_mask(q_len, window), scaling=scale,
                                      softcap=softcap)
    got = ops.prefill_attention(query[0].transpose(0, 1), k_cache, v_cache, table, torch.tensor([0, q_len]),
                                torch.tensor([q_len]), scale, window, softcap=softcap)
    torch.testing.assert_close(got, want[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [None, 4])
def test_reference_sinks_equal_gpt_oss_eager_attention(window) -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    heads, kv_heads, head_dim, q_len, scale = 4, 2, 16, 11, 0.3
    query, key, value, k_cache, v_cache, table = one_prompt_in_pages(q_len, heads, kv_heads, head_dim)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = heads // kv_heads, False
    module.sinks = torch.nn.Parameter(torch.tensor([3.0, -1.0, 0.5, 6.0]))
    want, _ = eager_attention_forward(module, query, key, value, causal_float_mask(q_len, window), scaling=scale)
    got = ops.prefill_attention(query[0].transpose(0, 1), k_cache, v_cache, table, torch.tensor([0, q_len]),
                                torch.tensor([q_len]), scale, window, sinks=module.sinks)
    torch.testing.assert_close(got, want[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(softcap=0.0), ValueError, "softcap must be a positive finite number"),
    (dict(softcap=-2.0), ValueError, "softcap must be a positive finite number"),
    (dict(sinks=torch.zeros(3)), ValueError, r"sinks \(s_aux\) must be \[num_heads=4\]"),
    (dict(sinks=torch.zeros(4, dtype=torch.long)), TypeError, "floating-point"),
])
def test_bad_softcap_or_sinks_are_refused(kwargs, error, message) -> None:
    _, _, _, k_cache, v_cache, table = one_prompt_in_pages(3, 4, 2, 16)
    with pytest.raises(error, match=message):
        ops.decode_attention(torch.zeros(1, 4, 16), k_cache, v_cache, table, torch.tensor([3]), 0.25, **kwargs)


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

