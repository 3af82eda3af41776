"""The C++ CPU kernels (cbcore._C: cache_write, decode_attention, prefill_attention) against the plain-torch
references in cbcore/ops/reference.py, which are the specification; then the dispatch in cbcore/ops, and the engine with the
kernels against the engine with the references.

Caches are filled with noise everywhere, requests' blocks are scattered in random order and the padding of the block
table points at real (noise) blocks, so reading a key that should not be seen changes the result.

Tolerances: fp32 atol = rtol = 1e-5. bf16/fp16: the kernel's output (rounded to bf16/fp16 once, at the end) against
the reference run in fp32 on the same bf16/fp16-rounded inputs, atol = rtol = 2e-2 (one bf16 rounding of the output is
up to 2^-8 relative; the rest is fp32 summation order).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cbcore
from cbcore import ops
from conftest import greedy_config, random_prompts, run_engine, tiny_model

_C = ops.cpu_kernels()
pytestmark = pytest.mark.skipif(_C is None, reason="cbcore._C was built without the CPU attention kernels")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def paged_cache(k_lens, page_size, kv_heads, head_dim, dtype, generator, v_head_dim=None):
    """Noise-filled caches and a block table giving each request ceil(len / page_size) blocks in random order; the
    rest of each table row points at other (noise) blocks. V pages have head dim v_head_dim (default head_dim)."""
    blocks_per_request = [-(-n // page_size) for n in k_lens]
    num_blocks = sum(blocks_per_request) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(blocks_per_request) + 1
    rows = []
    for count in blocks_per_request:
        own = [order.pop() for _ in range(count)]
        padding = torch.randint(0, num_blocks, (width - count,), generator=generator).tolist()
        rows.append(own + padding)
    shape = (num_blocks, page_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(*shape[:3], v_head_dim or head_dim, generator=generator).to(dtype)
    return k_cache, v_cache, torch.tensor(rows, dtype=torch.int32)


def assert_matches_reference(got, want_fp32, dtype):
    tol = TOLERANCE[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want_fp32.float(), atol=tol, rtol=tol)


def features(heads, softcap=None, sinks=False, generator=None):
    """The kernels' (softcap, sinks) arguments and the reference's: a cap small enough to bend the scores (their
    spread here is a few units), sink logits around the scores' size so they take a real share of the softmax."""
    sink = torch.randn(heads, generator=generator) * 2 if sinks else None
    return (softcap or 0.0, sink), dict(softcap=softcap, sinks=sink)


def decode_case(k_lens, page_size, heads, kv_heads, head_dim, window, dtype, seed=0, softcap=None, sinks=False,
                v_head_dim=None):
    generator = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table = paged_cache(k_lens, page_size, kv_heads, head_dim, dtype, generator, v_head_dim)
    q = torch.randn(len(k_lens), heads, head_dim, generator=generator).to(dtype)
    lens = torch.tensor(k_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    kernel_args, reference_kwargs = features(heads, softcap, sinks, generator)
    got = _C.decode_attention(q, k_cache, v_cache, table, lens, scale, -1 if window is None else window, *kernel_args)
    want = ops.decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), table, lens, scale, window,
                                          **reference_kwargs)
    return got, want


def prefill_case(k_lens, q_lens, page_size, heads, kv_heads, head_dim, window, dtype, seed=0, softcap=None,
                 sinks=False, v_head_dim=None):
    generator = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table = paged_cache(k_lens, page_size, kv_heads, head_dim, dtype, generator, v_head_dim)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=generator).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(k_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    kernel_args, reference_kwargs = features(heads, softcap, sinks, generator)
    got = _C.prefill_attention(q, k_cache, v_cache, table, cu, lens, scale, -1 if window is None else window,
                               *kernel_args)
    want = ops.prefill_attention_reference(q.float(), k_cache.float(), v_cache.float(), table, cu, lens, scale, window,
                                           **reference_kwargs)
    return got, want


def ragged_lengths(page_size):
    """A single token, both sides of a page boundary, several pages, and (1100) past the 1024-key split of decode."""
    return [1, page_size - 1, page_size, page_size + 1, 2 * page_size + 3, 37, 1100]


GQA = [(4, 4), (16, 4), (16, 2)]  # (heads, kv_heads): ratios 1, 4, 8


@pytest.mark.parametrize("page_size", [8, 16, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_matches_reference_fp32(page_size, heads, kv_heads, head_dim, window) -> None:
    got, want = decode_case(ragged_lengths(page_size), page_size, heads, kv_heads, head_dim, window, torch.float32)
    assert_matches_reference(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("window", [None, 7])
def test_decode_matches_reference_half_precision(dtype, heads, kv_heads, window) -> None:
    got, want = decode_case(ragged_lengths(16), 16, heads, kv_heads, 64, window, dtype)
    assert_matches_reference(got, want, dtype)


def prefill_lengths(page_size):
    """(k_lens, q_lens): a whole prompt, a chunk after a cached prefix, a single new token, a request with no query
    this step, a long prompt spanning several query and key tiles, and lengths around page boundaries."""
    k_lens = [1, page_size + 1, 2 * page_size + 5, 9, 150, page_size]
    q_lens = [1, page_size + 1, 7, 0, 150, 1]
    return k_lens, q_lens


@pytest.mark.parametrize("page_size", [8, 16, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_matches_reference_fp32(page_size, heads, kv_heads, head_dim, window) -> None:
    k_lens, q_lens = prefill_lengths(page_size)
    got, want = prefill_case(k_lens, q_lens, page_size, heads, kv_heads, head_dim, window, torch.float32)
    assert_matches_reference(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_matches_reference_half_precision(dtype, heads, kv_heads, window) -> None:
    k_lens, q_lens = prefill_lengths(16)
    got, want = prefill_case(k_lens, q_lens, 16, heads, kv_heads, 64, window, dtype)
    assert_matches_reference(got, want, dtype)


# ---- attention features: soft-capping, sinks, a V head dim of its own ------------------------------------------

FEATURES = {  # id -> (softcap, sinks)
    "softcap": (0.7, False),
    "sinks": (None, True),
    "softcap+sinks": (0.7, True),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("page_size", [8, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("window", [None, 7])
def test_decode_with_features_matches_reference_fp32(feature, page_size, heads, kv_heads, window) -> None:
    """1100 keys cross the 1024-key split: the sink must be counted once over the split-K merge."""
    softcap, sinks = FEATURES[feature]
    got, want = decode_case(ragged_lengths(page_size), page_size, heads, kv_heads, 64, window, torch.float32,
                            softcap=softcap, sinks=sinks)
    assert_matches_reference(got, want, torch.float32)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("page_size", [8, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_with_features_matches_reference_fp32(feature, page_size, heads, kv_heads, window) -> None:
    softcap, sinks = FEATURES[feature]
    k_lens, q_lens = prefill_lengths(page_size)
    got, want = prefill_case(k_lens, q_lens, page_size, heads, kv_heads, 64, window, torch.float32,
                             softcap=softcap, sinks=sinks)
    assert_matches_reference(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features_match_reference_half_precision(dtype, feature) -> None:
    softcap, sinks = FEATURES[feature]
    got, want = decode_case(ragged_lengths(16), 16, 16, 4, 64, 7, dtype, softcap=softcap, sinks=sinks)
    assert_matches_reference(got, want, dtype)
    k_lens, q_lens = prefill_lengths(16)
    got, want = prefill_case(k_lens, q_lens, 16, 16, 4, 64, 7, dtype, softcap=softcap, sinks=sinks)
    assert_matches_reference(got, want, dtype)


def test_features_change_the_result() -> None:
    """The cases above are not vacuous: soft-capping and sinks each move the output well past the tolerance."""
    plain, _ = decode_case([40, 300], 16, 8, 2, 64, None, torch.float32)
    for softcap, sinks in FEATURES.values():
        got, _ = decode_case([40, 300], 16, 8, 2, 64, None, torch.float32, softcap=softcap, sinks=sinks)
        assert (got - plain).abs().max() > 1e-2


@pytest.mark.parametrize(("head_dim", "v_head_dim"), [(24, 16), (192, 128), (64, 128)])
@pytest.mark.parametrize("window", [None, 7])
def test_separate_v_head_dim_matches_reference(head_dim, v_head_dim, window) -> None:
    """Multi-head latent attention (DeepSeek-V2/V3): V pages have their own head dim; the output has V's."""
    got, want = decode_case(ragged_lengths(16), 16, 8, 8, head_dim, window, torch.float32, sinks=True,
                            v_head_dim=v_head_dim)
    assert got.shape[-1] == v_head_dim
    assert_matches_reference(got, want, torch.float32)
    k_lens, q_lens = prefill_lengths(16)
    got, want = prefill_case(k_lens, q_lens, 16, 8, 8, head_dim, window, torch.float32, softcap=0.7,
                             v_head_dim=v_head_dim)
    assert got.shape[-1] == v_head_dim
    assert_matches_reference(got, want, torch.float32)


def test_cache_write_with_a_separate_v_head_dim() -> None:
    generator = torch.Generator().manual_seed(8)
    k = torch.randn(5, 2, 24, generator=generator)
    v = torch.randn(5, 2, 16, generator=generator)
    got_k, got_v = torch.zeros(3, 4, 2, 24), torch.zeros(3, 4, 2, 16)
    want_k, want_v = got_k.clone(), got_v.clone()
    slots = torch.tensor([11, 0, 5, 4, 7])
    _C.cache_write(k, v, got_k, got_v, slots)
    ops.cache_write_reference(k, v, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize(("change", "message"), [
    (dict(softcap=-1.0), "softcap must be 0"),
    (dict(sinks=torch.zeros(3)), r"sinks must be a contiguous float32 CPU tensor \[heads=2\]"),
    (dict(sinks=torch.zeros(2, dtype=torch.float64)), "sinks must be a contiguous float32"),
])
def test_bad_softcap_or_sinks_raise_value_error(change, message) -> None:
    k_cache = torch.zeros(4, 8, 1, 8)
    q = torch.zeros(1, 2, 8)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([9], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        _C.decode_attention(q, k_cache, k_cache, table, lens, 1.0, -1, change.get("softcap", 0.0), change.get("sinks"))
    with pytest.raises(ValueError, match=message):
        _C.prefill_attention(q, k_cache, k_cache, table, torch.tensor([0, 1], dtype=torch.int32), lens, 1.0, -1,
                             change.get("softcap", 0.0), change.get("sinks"))


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    page_size=st.sampled_from([1, 3, 8, 16, 64]),
    kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 3, 5, 8, 9]),
    head_dim=st.sampled_from([8, 24, 64, 80]),
    window=st.one_of(st.none(), st.integers(1, 40)),
    softcap=st.sampled_from([None, 0.5, 30.0]),
    sinks=st.booleans(),
)
def test_any_shape_matches_reference(data, page_size, kv_heads, group, head_dim, window, softcap, sinks) -> None:
    """Odd page sizes, group sizes and head dims (multiples of 8) too: every shape the kernels accept, with and
    without soft-capping and sinks."""
    k_lens = data.draw(st.lists(st.integers(1, 130), min_size=1, max_size=4))
    q_lens = [data.draw(st.integers(0, n)) for n in k_lens]
    heads = kv_heads * group
    got, want = decode_case(k_lens, page_size, heads, kv_heads, head_dim, window, torch.float32, softcap=softcap,
                            sinks=sinks)
    assert_matches_reference(got, want, torch.float32)
    got, want = prefill_case(k_lens, q_lens, page_size, heads, kv_heads, head_dim, window, torch.float32,
                             softcap=softcap, sinks=sinks)
    assert_matches_reference(got, want, torch.float32)


def test_strided_queries_are_read_in_place() -> None:
    """The attention function passes q as a transposed view ([T, heads, d] out of [1, heads, T, d])."""
    generator = torch.Generator().manual_seed(3)
    k_cache, v_cache, table = paged_cache([20, 5], 8, 2, 64, torch.float32, generator)
    query = torch.randn(1, 8, 2, 64, generator=generator)
    q = query[0].transpose(0, 1)
    assert not q.is_contiguous()
    lens = torch.tensor([20, 5], dtype=torch.int32)
    got = _C.decode_attention(q, k_cache, v_cache, table, lens, 0.125, -1)
    want = ops.decode_attention_reference(q, k_cache, v_cache, table, lens, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_results_do_not_depend_on_threads_or_batch() -> None:
    """Bitwise: each (request, kv head, chunk) is computed by one thread in a fixed order, and split-K chunk
    boundaries are fixed positions, so a request's output is the same alone or in any batch, on 1 or 2 threads."""
    generator = torch.Generator().manual_seed(4)
    k_lens = [2500, 40, 1100, 3]
    k_cache, v_cache, table = paged_cache(k_lens, 16, 4, 64, torch.float32, generator)
    q = torch.randn(len(k_lens), 16, 64, generator=generator)
    lens = torch.tensor(k_lens, dtype=torch.int32)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = _C.decode_attention(q, k_cache, v_cache, table, lens, 0.125, -1)
        torch.set_num_threads(1)
        for i in range(len(k_lens)):
            alone = _C.decode_attention(q[i:i + 1], k_cache, v_cache, table[i:i + 1], lens[i:i + 1], 0.125, -1)
            assert torch.equal(alone[0], batched[i]), f"request {i} changed with the batch or thread count"
    finally:
        torch.set_num_threads(previous)


# ---- every instruction set this machine has ---------------------------------------------------------------------

ISAS = ops.cpu_isas()


@pytest.fixture(params=ISAS)
def isa(request):
    """Each instruction set's copy of the kernels in turn (generic, avx2, avx512, avx512_bf16, avx512_amx: those
    this CPU runs)."""
    _C._set_cpu_attention_isa(request.param)
    assert _C.cpu_attention_isa() == request.param
    yield request.param
    _C._set_cpu_attention_isa("auto")


# 64/128/256 take the AVX-512 decode's 512-bit path (bf16: vdpbf16ps); 16 takes it without vdpbf16ps (which needs
# multiples of 32); 8, 24 and 40 are not multiples of 16 and fall back to the 8-lane code of the same copy.
ISA_HEAD_DIMS = [64, 128, 256, 16, 8, 24, 40]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim", ISA_HEAD_DIMS)
def test_every_isa_decode_matches_reference(isa, dtype, head_dim) -> None:
    """Ragged lengths (1100 crosses the split-K chunk), GQA 4, a window, then soft-capping with sinks."""
    lengths = ragged_lengths(16)
    got, want = decode_case(lengths, 16, 8, 2, head_dim, None, dtype)
    assert_matches_reference(got, want, dtype)
    got, want = decode_case(lengths, 16, 8, 2, head_dim, 7, dtype, softcap=0.7, sinks=True)
    assert_matches_reference(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 24])
def test_every_isa_prefill_matches_reference(isa, dtype, head_dim) -> None:
    k_lens, q_lens = prefill_lengths(8)
    got, want = prefill_case(k_lens, q_lens, 8, 8, 2, head_dim, None, dtype)
    assert_matches_reference(got, want, dtype)
    got, want = prefill_case(k_lens, q_lens, 8, 8, 2, head_dim, 7, dtype, softcap=0.7, sinks=True)
    assert_matches_reference(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("group", "v_head_dim"), [(1, 64), (3, 64), (5, 32), (8, 128)])
@pytest.mark.parametrize("window", [None, 70, 150])
def test_every_isa_prefill_skips_only_rows_that_see_nothing(isa, dtype, group, v_head_dim, window) -> None:
    """The AVX-512 prefill skips, per 64-key tile, the leading rows the causal mask hides all of it from and the
    trailing rows whose window ended before it. Prompts of 300 queries after 0 or 77 cached keys span several query
    tiles (128 rows / group) and key tiles; windows of 70 and 150 end inside and across tiles; group sizes that leave
    4-row blocks ragged."""
    k_lens, q_lens = [300, 377, 65], [300, 300, 64]
    got, want = prefill_case(k_lens, q_lens, 16, 2 * group, 2, 64, window, dtype, sinks=True, v_head_dim=v_head_dim)
    assert_matches_reference(got, want, dtype)


@pytest.mark.parametrize(("group", "v_head_dim"), [(1, 64), (3, 64), (8, 64), (9, 128), (4, 32)])
def test_every_isa_decode_group_sizes_and_v_head_dims(isa, group, v_head_dim) -> None:
    """Group sizes around the AVX-512 weighted sum's 4-row blocks, and a V head dim of its own (MLA)."""
    got, want = decode_case(ragged_lengths(16), 16, 2 * group, 2, 64, None, torch.bfloat16, sinks=True,
                            v_head_dim=v_head_dim)
    assert_matches_reference(got, want, torch.bfloat16)


def test_every_isa_cache_write(isa) -> None:
    generator = torch.Generator().manual_seed(9)
    k = torch.randn(7, 2, 64, generator=generator)
    v = torch.randn(7, 2, 64, generator=generator)
    got_k, got_v = torch.zeros(3, 4, 2, 64, dtype=torch.bfloat16), torch.zeros(3, 4, 2, 64, dtype=torch.bfloat16)
    want_k, want_v = got_k.clone(), got_v.clone()
    slots = torch.tensor([11, 0, 5, 4, 7, 1, 2])
    _C.cache_write(k, v, got_k, got_v, slots)
    ops.cache_write_reference(k, v, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_the_best_isa_is_the_default_and_every_isa_gives_nearly_the_same_result() -> None:
    assert _C.cpu_attention_isa() == ISAS[-1]
    results = {}
    try:
        for name in ISAS:
            _C._set_cpu_attention_isa(name)
            results[name], _ = decode_case([300, 41], 16, 8, 2, 64, None, torch.float32)
    finally:
        _C._set_cpu_attention_isa("auto")
    for name in ISAS:
        torch.testing.assert_close(results[name], results["generic"], atol=1e-5, rtol=1e-5)


def test_an_isa_this_cpu_lacks_or_an_unknown_name_raises() -> None:
    with pytest.raises(ValueError, match="unknown instruction set 'sse9'"):
        _C._set_cpu_attention_isa("sse9")
    assert _C.cpu_attention_isa() == ISAS[-1]


@pytest.mark.parametrize("value", ["generic", ISAS[-1], "auto"])
def test_cbcore_cpu_isa_forces_the_instruction_set(value) -> None:
    """The variable is read when cbcore.ops first loads the kernels: a fresh interpreter per value."""
    import subprocess
    import sys
    code = "from cbcore import ops; print(ops.available_backends()['cpu'])"
    env = dict(os.environ, CBCORE_CPU_ISA=value)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"cbcore._C ({ISAS[-1] if value == 'auto' else value})"


def test_cbcore_cpu_isa_naming_an_unavailable_set_raises_naming_the_variable() -> None:
    import subprocess
    import sys
    code = "from cbcore import ops; ops.available_backends()"
    env = dict(os.environ, CBCORE_CPU_ISA="avx1024")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "CBCORE_CPU_ISA='avx1024'" in result.stderr


@pytest.mark.parametrize(("cache_dtype", "src_dtype"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),  # converted on the way in, like the reference's k.to(cache dtype)
])
def test_cache_write_matches_reference(cache_dtype, src_dtype) -> None:
    generator = torch.Generator().manual_seed(5)
    num_blocks, page_size, kv_heads, head_dim = 6, 8, 2, 64
    key = torch.randn(1, kv_heads, 30, head_dim, generator=generator).to(src_dtype)
    k = key[0].transpose(0, 1)  # [T, kv_heads, d], strided like the attention function's
    v = torch.randn(30, kv_heads, head_dim, generator=generator).to(src_dtype)
    slots = torch.randperm(num_blocks * page_size, generator=generator)[:30]
    got_k = torch.randn(num_blocks, page_size, kv_heads, head_dim, generator=generator).to(cache_dtype)
    got_v = torch.randn_like(got_k)
    want_k, want_v = got_k.clone(), got_v.clone()
    _C.cache_write(k, v, got_k, got_v, slots)
    ops.cache_write_reference(k, v, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_cache_write_rejects_a_slot_outside_the_cache_and_writes_nothing() -> None:
    k_cache = torch.zeros(2, 4, 1, 8)
    v_cache = torch.zeros_like(k_cache)
    with pytest.raises(ValueError, match="slot 8 of token 1 is outside the cache"):
        _C.cache_write(torch.ones(2, 1, 8), torch.ones(2, 1, 8), k_cache, v_cache, torch.tensor([0, 8]))
    assert not k_cache.any()


@pytest.mark.parametrize(("change", "message"), [
    (dict(q_dtype=torch.bfloat16), "q is BFloat16 but the cache is Float"),
    (dict(lens=[0]), "request 0 has seq_len 0"),
    (dict(lens=[17]), "request 0 has 17 keys but its block table row holds 2 blocks"),
    (dict(table=[[0, 9]]), "block table entry 1 is 9, outside"),
    (dict(window=0), "sliding_window must be >= 1, or -1"),
])
def test_decode_rejects_bad_arguments_with_value_error(change, message) -> None:
    k_cache = torch.zeros(4, 8, 1, 8)
    q = torch.zeros(1, 2, 8, dtype=change.get("q_dtype", torch.float32))
    table = torch.tensor(change.get("table", [[0, 1]]), dtype=torch.int32)
    lens = torch.tensor(change.get("lens", [9]), dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        _C.decode_attention(q, k_cache, k_cache, table, lens, 1.0, change.get("window", -1))


# ---- dispatch (cbcore/ops) -----------------------------------------------------------------------------------------


def small_decode_inputs(dtype=torch.float32):
    generator = torch.Generator().manual_seed(6)
    k_cache, v_cache, table = paged_cache([5, 19], 8, 2, 64, dtype, generator)
    q = torch.randn(2, 4, 64, generator=generator).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor([5, 19], dtype=torch.int32), 0.125


def test_unknown_kernel_mode_raises_naming_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("CBCORE_KERNELS", "fastest")
    with pytest.raises(ValueError, match="CBCORE_KERNELS='fastest'"):
        ops.decode_attention(*small_decode_inputs())


def test_auto_uses_the_cpu_kernel_and_reference_mode_the_reference(monkeypatch) -> None:
    inputs = small_decode_inputs()
    kernel = _C.decode_attention(*inputs, -1)
    reference = ops.decode_attention_reference(*inputs)
    assert not torch.equal(kernel, reference), "inputs too easy: kernel and reference agree bitwise"
    monkeypatch.setenv("CBCORE_KERNELS", "auto")
    assert torch.equal(ops.decode_attention(*inputs), kernel)
    monkeypatch.setenv("CBCORE_KERNELS", "reference")
    assert torch.equal(ops.decode_attention(*inputs), reference)


def test_unsupported_dtype_falls_back_to_reference_in_auto_and_raises_when_cpu_is_forced(monkeypatch) -> None:
    inputs = small_decode_inputs(torch.float64)
    monkeypatch.setenv("CBCORE_KERNELS", "auto")
    torch.testing.assert_close(ops.decode_attention(*inputs), ops.decode_attention_reference(*inputs))
    monkeypatch.setenv("CBCORE_KERNELS", "cpu")
    with pytest.raises(RuntimeError, match="CBCORE_KERNELS=cpu but decode_attention cannot use that backend"):
        ops.decode_attention(*inputs)


def test_queries_with_a_strided_last_dimension_still_use_the_kernel(monkeypatch) -> None:
    q, k_cache, v_cache, table, lens, scale = small_decode_inputs()
    q_strided = torch.empty(*q.shape, 2).select(-1, 0).copy_(q)  # last-dimension stride 2
    monkeypatch.setenv("CBCORE_KERNELS", "cpu")
    got = ops.decode_attention(q_strided, k_cache, v_cache, table, lens, scale)
    assert torch.equal(got, _C.decode_attention(q, k_cache, v_cache, table, lens, scale, -1))


def test_softcap_and_model_dtype_sinks_run_the_cpu_kernel(monkeypatch) -> None:
    """No fallback for the features: ops hands them to the kernel (sinks converted from the model's dtype to fp32)."""
    q, k_cache, v_cache, table, lens, scale = small_decode_inputs()
    sinks = torch.tensor([1.5, -0.5, 3.0, 0.25], dtype=torch.bfloat16)
    monkeypatch.setenv("CBCORE_KERNELS", "cpu")
    got = ops.decode_attention(q, k_cache, v_cache, table, lens, scale, None, 0.7, sinks)
    assert torch.equal(got, _C.decode_attention(q, k_cache, v_cache, table, lens, scale, -1, 0.7, sinks.float()))
    torch.testing.assert_close(got, ops.decode_attention_reference(q, k_cache, v_cache, table, lens, scale, None, 0.7,
                                                                   sinks), atol=1e-5, rtol=1e-5)


def test_available_backends_reports_the_cpu_kernels(monkeypatch) -> None:
    monkeypatch.delenv("CBCORE_KERNELS", raising=False)
    backends = ops.available_backends()
    assert backends["mode"] == "auto"
    assert backends["cpu"] == f"cbcore._C ({_C.cpu_attention_isa()})"


# ---- engine -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "page_size"), [("mistral_sliding", 4), ("llama_gqa", 16)])
def test_engine_gives_the_same_tokens_with_kernels_and_with_references(monkeypatch, kind, page_size) -> None:
    model = tiny_model(kind)
    prompts = random_prompts([1, 7, 16, 33, 70], seed=11)
    config = cbcore.ContinuousBatchingConfig(page_size=page_size, max_batch_tokens=24)
    tokens = {}
    for mode in ("reference", "auto"):
        monkeypatch.setenv("CBCORE_KERNELS", mode)
        outputs, _ = run_engine(model, prompts, greedy_config(10), config)
        tokens[mode] = [output.generated_tokens for output in outputs.values()]
    assert tokens["auto"] == tokens["reference"]
