"""The CUDA kernels of cbcore._cuda against the plain-torch references in cbcore/ops/reference.py (the specification).

Every test marked `gpu` needs a CUDA device and is skipped without one (run them with `pytest -m gpu`, as
bench/gpu_check.sh does). The unmarked tests run everywhere: the extension is built whenever torch has CUDA and nvcc
exists, and it imports (and refuses CPU tensors clearly) on a machine with no GPU.

Tolerances, against the reference computed in fp32 from the same (already rounded) inputs: the kernels accumulate in
fp32 and round once at the end, so the output may differ from the reference by about one unit in the last place of
its dtype, plus fp32 summation-order noise:
    float32: atol = rtol = 2e-5;  bfloat16: atol = rtol = 1.6e-2 (2 ulp at 1.0);  float16: atol = rtol = 2e-3.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from cbcore import ops

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _skip_gpu_tests_without_cuda(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def cuda_module():
    from cbcore import _cuda

    return _cuda


# ---- everywhere --------------------------------------------------------------------------------------------------


def nvcc_found() -> bool:
    cuda_home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return bool(cuda_home and Path(cuda_home, "bin", "nvcc").exists()) or shutil.which("nvcc") is not None


@pytest.mark.skipif(not (torch.version.cuda and nvcc_found()), reason="torch without CUDA or no nvcc: not built")
def test_cuda_extension_is_built_when_torch_has_cuda_and_nvcc_exists() -> None:
    spec = importlib.util.find_spec("cbcore._cuda")
    assert spec is not None and spec.origin and Path(spec.origin).exists(), (
        "cbcore._cuda is missing although torch has CUDA and nvcc exists; reinstall with "
        "`CUDA_HOME=/usr/local/cuda pip install --no-build-isolation -e .`"
    )


@pytest.mark.skipif(importlib.util.find_spec("cbcore._cuda") is None, reason="cbcore._cuda is not built")
def test_cuda_extension_imports_and_refuses_cpu_tensors() -> None:
    cuda = cuda_module()
    q = torch.randn(2, 4, 64)
    cache = torch.randn(3, 8, 2, 64)
    table = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="decode_attention: q must be a CUDA tensor"):
        cuda.decode_attention(q, cache, cache, table, lens, 0.125)
    with pytest.raises(RuntimeError, match="cache_write: k_cache must be a CUDA tensor"):
        cuda.cache_write(torch.randn(1, 2, 64), torch.randn(1, 2, 64), cache, cache, torch.zeros(1, dtype=torch.int64))
    assert cuda.DETERMINISTIC_SPLIT_TOKENS == 256


# ---- helpers -----------------------------------------------------------------------------------------------------


def make_paged(lengths: list[int], num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
               dtype: torch.dtype, seed: int = 0, spare_blocks: int = 3):
    """q, K/V caches and a block table whose pages are scattered over the cache in shuffled order."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_request = [-(-n // page_size) for n in lengths]
    num_blocks = sum(blocks_per_request) + spare_blocks
    shape = (num_blocks, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", generator=generator).to(dtype)
    v_cache = torch.randn(shape, device="cuda", generator=generator).to(dtype)
    q = torch.randn(len(lengths), num_heads, head_dim, device="cuda", generator=generator).to(dtype)
    order = torch.randperm(num_blocks, device="cuda", generator=generator).to(torch.int32)
    width = max(max(blocks_per_request), 1)
    table = torch.zeros(len(lengths), width, dtype=torch.int32, device="cuda")
    start = 0
    for i, count in enumerate(blocks_per_request):
        table[i, :count] = order[start:start + count]
        start += count
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, table, seq_lens


def reference_decode(q, k_cache, v_cache, table, seq_lens, scale, window):
    return ops.decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), table, seq_lens, scale,
                                          None if window == -1 else window)


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def run_decode(lengths, num_heads, num_kv_heads, head_dim, page_size, dtype, window=-1, deterministic=False, seed=0,
               softcap=None, sinks=None):
    q, k_cache, v_cache, table, seq_lens = make_paged(lengths, num_heads, num_kv_heads, head_dim, page_size, dtype,
                                                      seed)
    scale = 1 / math.sqrt(head_dim)
    sinks = None if sinks is None else sinks.float().cuda()
    out = cuda_module().decode_attention(q, k_cache, v_cache, table, seq_lens, scale, window, deterministic,
                                         softcap or 0.0, sinks)
    ref = ops.decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), table, seq_lens, scale,
                                         None if window == -1 else window, softcap, sinks)
    return out, ref


# Ragged, with a single token and lengths on both sides of page boundaries for page sizes 8 and 16.
RAGGED = [1, 7, 8, 9, 16, 17, 33, 100, 301, 1000]


# ---- decode attention --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (16, 4), (32, 4)], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("page_size", [8, 16, 256])
def test_decode_matches_reference(dtype, head_dim, num_heads, num_kv_heads, page_size) -> None:
    lengths = RAGGED + ([255, 256, 257, 513] if page_size == 256 else [])
    out, ref = run_decode(lengths, num_heads, num_kv_heads, head_dim, page_size, dtype)
    assert_close_to_reference(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(3, 1), (28, 4), (16, 1), (40, 2), (64, 1)],
                         ids=["gqa3", "gqa7", "gqa16", "gqa20", "mqa64"])
def test_decode_group_sizes_that_are_not_a_padded_power_of_two(num_heads, num_kv_heads) -> None:
    out, ref = run_decode(RAGGED, num_heads, num_kv_heads, 128, 16, torch.bfloat16)
    assert_close_to_reference(out, ref, torch.bfloat16)


@pytest.mark.gpu
def test_decode_single_request_single_token_returns_that_tokens_values() -> None:
    q, k_cache, v_cache, table, seq_lens = make_paged([1], 8, 2, 128, 16, torch.float32)
    out = cuda_module().decode_attention(q, k_cache, v_cache, table, seq_lens, 0.1)
    # One key: every query head of a kv head gets that kv head's value row.
    expected = v_cache[table[0, 0].long(), 0]  # [kv_heads, head_dim]
    torch.testing.assert_close(out[0], expected.repeat_interleave(4, dim=0), atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [1, 5, 16, 64, 1000, 5000])
def test_decode_sliding_window(dtype, window) -> None:
    out, ref = run_decode(RAGGED + [2000, 4097], 16, 4, 128, 16, dtype, window=window)
    assert_close_to_reference(out, ref, dtype)


def sink_logits(num_heads: int, seed: int = 0) -> torch.Tensor:
    """Sink logits about the size of the scores, so each takes a real share of its softmax."""
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("softcap", "with_sinks"), [(0.7, False), (None, True), (30.0, True)],
                         ids=["softcap", "sinks", "softcap30+sinks"])
@pytest.mark.parametrize("window", [-1, 64])
@pytest.mark.parametrize("deterministic", [False, True])
def test_decode_softcap_and_sinks(dtype, softcap, with_sinks, window, deterministic) -> None:
    # Lengths from one key to many splits: the sink joins once, in the one-split direct write or in the merge.
    sinks = sink_logits(16) if with_sinks else None
    out, ref = run_decode(RAGGED + [4097], 16, 4, 128, 16, dtype, window=window, deterministic=deterministic,
                          softcap=softcap, sinks=sinks)
    assert_close_to_reference(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_decode_split_k_over_long_contexts(dtype, deterministic) -> None:
    # A lone 16k request gets many splits; beside it, short ones finish in one split in the same launch.
    out, ref = run_decode([16384, 3, 16000, 700], 32, 8, 128, 16, dtype, deterministic=deterministic)
    assert_close_to_reference(out, ref, dtype)


@pytest.mark.gpu
def test_decode_split_k_at_every_split_size() -> None:
    # Batch sizes chosen so that non-deterministic mode picks each split size from 1024 down to 64.
    cuda = cuda_module()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    picked = set()
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        split = cuda.decode_split_tokens(batch * 2, 4096, False, num_sms)
        if split in picked:
            continue
        picked.add(split)
        lengths = [4096 - 37 * i for i in range(batch)]
        out, ref = run_decode(lengths, 8, 2, 64, 16, torch.float32, seed=batch)
        assert_close_to_reference(out, ref, torch.float32)
    assert len(picked) >= 3


@pytest.mark.gpu
@pytest.mark.parametrize("window", [-1, 300])
def test_deterministic_mode_is_bitwise_independent_of_the_batch(window) -> None:
    cuda = cuda_module()
    num_heads, num_kv_heads, head_dim, page_size, dtype = 32, 8, 128, 16, torch.bfloat16
    lengths = [5000, 1, 9000, 17, 260, 4096, 12000]
    q, k_cache, v_cache, table, seq_lens = make_paged(lengths, num_heads, num_kv_heads, head_dim, page_size, dtype)
    scale = 1 / math.sqrt(head_dim)
    full = cuda.decode_attention(q, k_cache, v_cache, table, seq_lens, scale, window, True)
    # Each request alone (a narrower block table), in reverse order, and inside a batch padded with many others.
    for i in range(len(lengths)):
        width = -(-lengths[i] // page_size)
        alone = cuda.decode_attention(q[i:i + 1], k_cache, v_cache, table[i:i + 1, :width].contiguous(),
                                      seq_lens[i:i + 1], scale, window, True)
        assert torch.equal(alone[0], full[i]), f"request {i} differs when it runs alone"
    reverse = torch.arange(len(lengths) - 1, -1, -1, device="cuda")
    reordered = cuda.decode_attention(q[reverse], k_cache, v_cache, table[reverse], seq_lens[reverse], scale, window,
                                      True)
    assert torch.equal(reordered, full[reverse])
    crowd = torch.arange(64, device="cuda") % len(lengths)
    crowded = cuda.decode_attention(q[crowd], k_cache, v_cache, table[crowd], seq_lens[crowd], scale, window, True)
    assert torch.equal(crowded, full[crowd])
    ref = reference_decode(q, k_cache, v_cache, table, seq_lens, scale, window)
    assert_close_to_reference(full, ref, dtype)


@pytest.mark.gpu
def test_decode_reads_a_strided_query() -> None:
    # The attention layer's decode rows are a view of [1, heads, tokens, head_dim]: rows strided, last dim contiguous.
    q, k_cache, v_cache, table, seq_lens = make_paged([40, 3, 77], 8, 2, 64, 16, torch.bfloat16)
    packed = torch.randn(1, 8, 5, 64, device="cuda").to(torch.bfloat16)
    packed[0, :, 1:4] = q.transpose(0, 1)
    strided = packed[0, :, 1:4].transpose(0, 1)
    assert not strided.is_contiguous()
    out = cuda_module().decode_attention(strided, k_cache, v_cache, table, seq_lens, 0.125)
    expected = cuda_module().decode_attention(q, k_cache, v_cache, table, seq_lens, 0.125)
    assert torch.equal(out, expected)


@pytest.mark.gpu
def test_decode_request_with_no_keys_gets_zeros() -> None:
    q, k_cache, v_cache, table, _ = make_paged([5, 5], 4, 2, 64, 8, torch.float32)
    out = cuda_module().decode_attention(q, k_cache, v_cache, table,
                                         torch.tensor([0, 5], dtype=torch.int32, device="cuda"), 0.125)
    assert not out[0].any()
    assert out[1].abs().sum() > 0


@pytest.mark.gpu
def test_decode_through_ops_dispatches_to_cuda(monkeypatch) -> None:
    monkeypatch.setenv("CBCORE_KERNELS", "cuda")
    q, k_cache, v_cache, table, seq_lens = make_paged(RAGGED, 16, 4, 128, 16, torch.bfloat16)
    out = ops.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.088, None)
    assert_close_to_reference(out, reference_decode(q, k_cache, v_cache, table, seq_lens, 0.088, -1), torch.bfloat16)


@pytest.mark.gpu
def test_decode_through_ops_passes_softcap_and_model_dtype_sinks(monkeypatch) -> None:
    # GPT-OSS hands its sinks over as a bf16 parameter; ops converts them to the kernel's fp32.
    monkeypatch.setenv("CBCORE_KERNELS", "cuda")
    q, k_cache, v_cache, table, seq_lens = make_paged(RAGGED, 16, 4, 128, 16, torch.bfloat16)
    sinks = sink_logits(16).to(torch.bfloat16).cuda()
    out = ops.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.088, None, 5.0, sinks)
    ref = ops.decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), table, seq_lens, 0.088, None,
                                         5.0, sinks)
    assert_close_to_reference(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(16, 16), (16, 2)], ids=["mla", "gqa8"])
def test_decode_latent_attention_head_dims(dtype, num_heads, num_kv_heads) -> None:
    # DeepSeek-V3's per-head dims: K 192 = 128 + 64 rotary, V 128.
    q, k_cache, _, table, seq_lens = make_paged(RAGGED + [4097], num_heads, num_kv_heads, 192, 16, dtype)
    v_cache = torch.randn(*k_cache.shape[:3], 128, device="cuda").to(dtype)
    sinks = sink_logits(num_heads).cuda()
    out = cuda_module().decode_attention(q, k_cache, v_cache, table, seq_lens, 0.07, -1, False, 0.0, sinks)
    ref = ops.decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), table, seq_lens, 0.07,
                                         sinks=sinks)
    assert_close_to_reference(out, ref, dtype)


@pytest.mark.gpu
def test_decode_with_head_dims_not_compiled_runs_the_reference_in_auto_and_raises_when_cuda_is_forced(
        monkeypatch) -> None:
    q, k_cache, _, table, seq_lens = make_paged([5, 40], 8, 2, 128, 16, torch.float32)
    v_cache = torch.randn(*k_cache.shape[:3], 64, device="cuda")
    monkeypatch.setenv("CBCORE_KERNELS", "auto")
    out = ops.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.088)
    assert out.shape == (2, 8, 64)
    monkeypatch.setenv("CBCORE_KERNELS", "cuda")
    with pytest.raises(RuntimeError, match="head dims K 128 / V 64"):
        ops.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.088)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must be int32"),
        (lambda a: a.update(block_table=a["block_table"].long()), "block_table must be int32"),
        (lambda a: a.update(q=a["q"].float()), "all three must have the same dtype"),
        (lambda a: a.update(q=a["q"][:, :, :32].contiguous()), "q has head_dim 32 but the cache has 64"),
        (lambda a: a.update(q=a["q"][:, :3]), "not a multiple of the cache's 2 kv heads"),
        (lambda a: a.update(q=a["q"].cpu()), "q must be a CUDA tensor"),
        (lambda a: a.update(k_cache=a["k_cache"].transpose(2, 3)), "must be contiguous|has shape"),
        (lambda a: a.update(sliding_window=0), "sliding_window must be -1"),
        (lambda a: a.update(block_table=a["block_table"][:1]), r"block_table must be \[batch=2"),
    ],
)
def test_decode_rejects_bad_inputs_with_a_clear_message(change, message) -> None:
    q, k_cache, v_cache, table, seq_lens = make_paged([5, 9], 4, 2, 64, 8, torch.bfloat16)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table, seq_lens=seq_lens, scale=0.125,
                sliding_window=-1, deterministic=False)
    change(args)
    with pytest.raises(RuntimeError, match=message):
        cuda_module().decode_attention(**args)


@pytest.mark.gpu
def test_decode_rejects_unsupported_head_dim_and_page_size() -> None:
    cuda = cuda_module()
    q, k_cache, v_cache, table, seq_lens = make_paged([5], 4, 2, 96, 8, torch.float16)
    with pytest.raises(RuntimeError, match="head_dim must be 64, 128 or 256 .*; got K 96, V 96"):
        cuda.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.1)
    q, k_cache, v_cache, table, seq_lens = make_paged([5], 4, 2, 64, 12, torch.float16)
    with pytest.raises(RuntimeError, match="page_size .* must be a power of two, got 12"):
        cuda.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.1)


# ---- cache write -------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [8, 16, 256])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (8, 128), (4, 256), (2, 80), (3, 4)])
def test_cache_write_matches_reference(dtype, page_size, num_kv_heads, head_dim) -> None:
    generator = torch.Generator(device="cuda").manual_seed(page_size + head_dim)
    num_blocks, num_tokens = 6, 100
    shape = (num_blocks, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", generator=generator).to(dtype)
    v_cache = torch.randn(shape, device="cuda", generator=generator).to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", generator=generator).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", generator=generator).to(dtype)
    slots = torch.randperm(num_blocks * page_size, device="cuda", generator=generator)[:num_tokens]
    cuda_module().cache_write(k, v, k_cache, v_cache, slots)
    ops.cache_write_reference(k, v, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.gpu
def test_cache_write_takes_strided_rows_and_skips_negative_slots() -> None:
    # k and v as the attention layer has them: [1, kv_heads, tokens, head_dim] viewed as [tokens, kv_heads, head_dim].
    k_cache = torch.zeros(4, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(1, 2, 10, 128, device="cuda").to(torch.bfloat16)
    value = torch.randn(1, 2, 10, 128, device="cuda").to(torch.bfloat16)
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    slots = torch.arange(10, device="cuda") * 5
    slots[3] = -1
    cuda_module().cache_write(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 128), v_cache.view(-1, 2, 128)
    keep = [i for i in range(10) if i != 3]
    assert torch.equal(flat_k[slots[keep]], k[keep]) and torch.equal(flat_v[slots[keep]], v[keep])
    assert int((flat_k.abs().sum(dim=(1, 2)) > 0).sum()) == 9


@pytest.mark.gpu
def test_cache_write_rejects_mismatched_inputs() -> None:
    cache = torch.zeros(4, 16, 2, 64, device="cuda")
    k = torch.randn(3, 2, 64, device="cuda")
    slots = torch.arange(3, device="cuda")
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        cuda_module().cache_write(k, k, cache, cache, slots.int())
    with pytest.raises(RuntimeError, match="must share one dtype"):
        cuda_module().cache_write(k.half(), k.half(), cache, cache, slots)
    with pytest.raises(RuntimeError, match=r"k must be \[num_tokens, kv_heads=2, head_dim=64\]"):
        cuda_module().cache_write(k[:, :1], k[:, :1], cache, cache, slots)


# ---- swap pool on CUDA caches ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("pin", [None, False], ids=["pinned", "pageable"])
def test_swap_round_trip_on_cuda_caches(pin) -> None:
    from cbcore import _C

    num_layers, num_blocks = 4, 40
    shape = (num_blocks, 16, 2, 128)
    keys = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(num_layers)]
    values = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(num_layers)]
    pool = _C.SwapPool(num_layers, 32, 16, 2, 128, torch.bfloat16, pin=pin)
    assert pool.pinned == (pin is None)
    out_ids = torch.randperm(num_blocks)[:20]
    host_ids = torch.randperm(32)[:20]
    saved = [(k[out_ids.cuda()].clone(), v[out_ids.cuda()].clone()) for k, v in zip(keys, values)]
    pool.swap_out(keys, values, out_ids, host_ids)
    pool.wait_on_current_stream()
    for k, v in zip(keys, values):
        k.fill_(0)
        v.fill_(0)
    in_ids = torch.randperm(num_blocks)[:20]
    pool.swap_in(keys, values, host_ids, in_ids)
    pool.wait_on_current_stream()
    for layer, (k, v) in enumerate(zip(keys, values)):
        assert torch.equal(k[in_ids.cuda()], saved[layer][0])
        assert torch.equal(v[in_ids.cuda()], saved[layer][1])
    pool.synchronize()
    assert pool.query()
    for layer in range(num_layers):
        assert torch.equal(pool.key(layer)[host_ids], saved[layer][0].cpu())


@pytest.mark.gpu
def test_swap_out_sees_writes_queued_before_it() -> None:
    from cbcore import _C

    keys = [torch.zeros(8, 16, 2, 64, device="cuda")]
    values = [torch.zeros(8, 16, 2, 64, device="cuda")]
    pool = _C.SwapPool(1, 8, 16, 2, 64, torch.float32)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(10):  # keep the current stream busy so that the copy would overtake a missing dependency
        big = big @ big / 64
    keys[0][3].fill_(5.0)
    pool.swap_out(keys, values, [3], [6])
    pool.synchronize()
    assert bool((pool.key(0)[6] == 5.0).all())
