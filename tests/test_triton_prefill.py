"""The Triton prefill kernel against its specification, `cbcore.ops.prefill_attention_reference`.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, with small shapes: the
interpreter runs programs one by one in numpy. Triton fixes interpreter-or-compiler for its own library when it is
first imported, and the test session has imported it long before this module (conftest imports transformers' models,
which import torch._dynamo, which imports triton). So, unless TRITON_INTERPRET=1 was already set when Triton was
imported, the interpreter cases run in one child pytest over this file with TRITON_INTERPRET=1
(test_interpreter_cases_in_a_subprocess), and are skipped here. To see them one by one:

    TRITON_INTERPRET=1 python -m pytest tests/test_triton_prefill.py

Tests marked `gpu` run the same comparisons compiled, at realistic sizes, in the parent process.

Every cache starts filled with NaN and block-table padding points at a NaN block: a kernel that reads a slot past a
request's length, or a padding entry, turns the output into NaN instead of passing by luck.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cbcore import ops

triton = pytest.importorskip("triton")
from cbcore.triton_kernels.prefill import PrefillTiles, prefill_attention  # noqa: E402

# Whether this process runs Triton's interpreter: asked for now, and Triton's own library built for it on import.
INTERPRETER_HERE = bool(triton.knobs.runtime.interpret) and not isinstance(triton.language.zeros, triton.JITFunction)
CHILD_FLAG = "CBCORE_TRITON_INTERPRETER_CHILD"

interpreted = pytest.mark.skipif(
    not INTERPRETER_HERE, reason="Triton runs compiled in this process: test_interpreter_cases_in_a_subprocess runs it"
)
needs_compiled_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETER_HERE, reason="needs a CUDA device and compiled Triton"
)

# (q_len, k_len) per request: a one-token prompt, a decode-like query over a prefix crossing pages, a whole prompt
# crossing pages (q_len == k_len), a chunk after a cached prefix long enough to have key tiles every row sees in full.
RAGGED = [(1, 1), (1, 21), (19, 19), (7, 40), (5, 5)]


def make_batch(requests, page_size, heads, kv_heads, head_dim, dtype=torch.float32, device="cpu", seed=0,
               v_head_dim=None):
    """Random queries and K/V written through `ops.cache_write` into shuffled pages; returns the kernel's arguments.
    V pages have head dim v_head_dim (default head_dim)."""
    v_head_dim = v_head_dim or head_dim
    generator = torch.Generator().manual_seed(seed)
    q_lens = [q for q, _ in requests]
    k_lens = [k for _, k in requests]
    blocks_per_request = [-(-k // page_size) for k in k_lens]
    num_blocks = sum(blocks_per_request) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    k_cache = torch.full((num_blocks, page_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full((num_blocks, page_size, kv_heads, v_head_dim), float("nan"), dtype=dtype)
    tables = []
    for k_len, count in zip(k_lens, blocks_per_request):
        blocks = [order.pop() for _ in range(count)]
        tables.append(blocks)
        positions = torch.arange(k_len)
        slots = torch.tensor(blocks, dtype=torch.long)[positions // page_size] * page_size + positions % page_size
        keys = torch.randn(k_len, kv_heads, head_dim, generator=generator)
        values = torch.randn(k_len, kv_heads, v_head_dim, generator=generator)
        ops.cache_write(keys, values, k_cache, v_cache, slots)
    nan_block = order.pop()  # never written: every slot stays NaN
    width = max(blocks_per_request) + 1
    table = torch.tensor([t + [nan_block] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=generator).to(dtype)
    cu_seqlens_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens_k = torch.tensor(k_lens, dtype=torch.int32)
    args = (q, k_cache, v_cache, table, cu_seqlens_q, seq_lens_k)
    return tuple(t.to(device) for t in args)


def assert_matches_reference(args, window, atol, rtol, tiles=None, softcap=None, sinks=None):
    head_dim = args[0].shape[-1]
    scale = head_dim**-0.5
    got = prefill_attention(*args, scale, window, softcap, sinks, tiles=tiles)
    want = ops.prefill_attention_reference(*args, scale, window, softcap, sinks)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not got.isnan().any(), "the kernel read a slot it must not read (NaN from an unused slot or padding)"
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


# ---- interpreter (CPU) -----------------------------------------------------------------------------------------------


@pytest.mark.skipif(INTERPRETER_HERE or os.environ.get(CHILD_FLAG) == "1", reason="the cases run in this process")
def test_interpreter_cases_in_a_subprocess() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", CHILD_FLAG: "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "not gpu", __file__]
    child = subprocess.run(command, env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                           timeout=600)
    report = child.stdout[-20000:] + child.stderr[-5000:]
    assert child.returncode == 0, f"interpreter cases failed (rerun: TRITON_INTERPRET=1 {' '.join(command)}):\n{report}"
    assert "Triton runs compiled in this process" not in child.stdout, f"the child did not interpret:\n{report}"


@interpreted
@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (4, 1), (8, 1), (6, 2)], ids=["mha", "gqa4", "gqa8", "gqa3"])
@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window5"])
def test_ragged_batch_matches_reference(page_size, heads, kv_heads, window) -> None:
    args = make_batch(RAGGED, page_size, heads, kv_heads, head_dim=16, seed=page_size + heads)
    assert_matches_reference(args, window, atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("head_dim", [32, 64, 128, 80], ids=["d32", "d64", "d128", "d80_padded"])
def test_head_dims_match_reference(head_dim) -> None:
    args = make_batch([(3, 3), (9, 20)], page_size=8, heads=4, kv_heads=1, head_dim=head_dim, seed=head_dim)
    assert_matches_reference(args, None, atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window5"])
def test_half_precision_matches_reference(dtype, tolerance, window) -> None:
    # Both sides round the output to bf16 (8-bit mantissa) / fp16 (11-bit); the kernel also rounds P before P @ V,
    # which about doubles its error against an fp32 computation (bf16 here: kernel 0.016, reference 0.008).
    args = make_batch(RAGGED, page_size=16, heads=8, kv_heads=2, head_dim=16, dtype=dtype, seed=7)
    assert_matches_reference(args, window, atol=tolerance, rtol=tolerance)


@interpreted
def test_cache_dtype_other_than_the_query_dtype_is_converted_on_load() -> None:
    # The reference converts K/V to q's dtype; so does the kernel (ops.prefill_attention may pass such a mix).
    q, k_cache, v_cache, *rest = make_batch(RAGGED, page_size=8, heads=4, kv_heads=2, head_dim=16, seed=9)
    assert_matches_reference((q.half(), k_cache, v_cache, *rest), None, atol=4e-3, rtol=4e-3)


@interpreted
def test_page_larger_than_key_tile() -> None:
    args = make_batch([(40, 300), (5, 5)], page_size=256, heads=2, kv_heads=1, head_dim=16, seed=3)
    assert_matches_reference(args, None, atol=1e-5, rtol=1e-5)


@interpreted
def test_page_size_need_not_be_a_power_of_two() -> None:
    args = make_batch(RAGGED, page_size=12, heads=4, kv_heads=2, head_dim=16, seed=4)
    assert_matches_reference(args, 5, atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("window", [None, 26], ids=["causal", "window26"])
@pytest.mark.parametrize("tiles", [PrefillTiles(16, 16), PrefillTiles(64, 16)], ids=["m16n16", "m64n16"])
def test_many_key_tiles_with_unmasked_interior(tiles, window) -> None:
    # Small key tiles over a long prefix: interior tiles skip the mask, window edges and the diagonal apply it. With
    # window 26 the first query (position 40) sees keys from 15 on: the last key of a 16-key tile is its first key.
    args = make_batch([(30, 70), (1, 50), (12, 12)], page_size=8, heads=2, kv_heads=1, head_dim=16, seed=5)
    assert_matches_reference(args, window, atol=1e-5, rtol=1e-5, tiles=tiles)


@interpreted
@pytest.mark.parametrize("window", [None, 40], ids=["causal", "window40"])
def test_every_alignment_of_queries_to_key_tiles(window) -> None:
    # 16 requests whose 16-query tile starts at each of the 16 offsets within a 16-key tile, so the window start, the
    # diagonal and the edges of the run of tiles that skip the mask each fall on every offset: an off-by-one in any of
    # them shows up in one request.
    requests = [(16, 70 + shift) for shift in range(16)]
    args = make_batch(requests, page_size=8, heads=1, kv_heads=1, head_dim=16, seed=8)
    assert_matches_reference(args, window, atol=1e-5, rtol=1e-5, tiles=PrefillTiles(16, 16))


@interpreted
def test_strided_query_view() -> None:
    # transformers hands attention a query [1, heads, T, d]; its [T, heads, d] view is not contiguous.
    q, *rest = make_batch(RAGGED, page_size=8, heads=4, kv_heads=2, head_dim=16, seed=6)
    strided_q = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided_q.is_contiguous()
    assert_matches_reference((strided_q, *rest), None, atol=1e-5, rtol=1e-5)


# Soft-capping and sinks (cbcore.ops module docstring): a cap that bends scores of a few units, sinks of about their
# size so that they take a real share of each softmax.
FEATURES = {"softcap": (0.7, False), "sinks": (None, True), "softcap+sinks": (0.7, True)}


def sink_logits(heads, seed=0):
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2


@interpreted
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (8, 1), (6, 2)], ids=["mha", "gqa8", "gqa3"])
@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window5"])
def test_softcap_and_sinks_match_reference(feature, heads, kv_heads, window) -> None:
    softcap, with_sinks = FEATURES[feature]
    args = make_batch(RAGGED, 8, heads, kv_heads, head_dim=16, seed=heads)
    sinks = sink_logits(heads) if with_sinks else None
    assert_matches_reference(args, window, atol=1e-5, rtol=1e-5, softcap=softcap, sinks=sinks)


@interpreted
@pytest.mark.parametrize("window", [None, 26], ids=["causal", "window26"])
def test_sinks_over_many_key_tiles(window) -> None:
    # The sink's share is rescaled by every later key tile, interior (unmasked) tiles included.
    args = make_batch([(30, 70), (1, 50), (12, 12)], page_size=8, heads=2, kv_heads=1, head_dim=16, seed=5)
    assert_matches_reference(args, window, atol=1e-5, rtol=1e-5, tiles=PrefillTiles(16, 16), softcap=2.0,
                             sinks=sink_logits(2, seed=1))


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_softcap_and_sinks_half_precision(dtype) -> None:
    args = make_batch(RAGGED, page_size=16, heads=8, kv_heads=2, head_dim=16, dtype=dtype, seed=7)
    assert_matches_reference(args, 5, atol=2e-2, rtol=2e-2, softcap=0.7, sinks=sink_logits(8))


@interpreted
@pytest.mark.parametrize(("head_dim", "v_head_dim"), [(24, 16), (16, 32)])
def test_separate_v_head_dim_matches_reference(head_dim, v_head_dim) -> None:
    # Multi-head latent attention (DeepSeek-V2/V3): V has its own head dim, and so does the output.
    args = make_batch(RAGGED, page_size=8, heads=4, kv_heads=2, head_dim=head_dim, seed=2, v_head_dim=v_head_dim)
    assert_matches_reference(args, 5, atol=1e-5, rtol=1e-5, sinks=sink_logits(4))


@interpreted
def test_empty_batch_returns_empty_output() -> None:
    q, k_cache, v_cache, *_ = make_batch([(1, 1)], page_size=8, heads=2, kv_heads=1, head_dim=16)
    out = prefill_attention(q[:0], k_cache, v_cache, torch.zeros(0, 1, dtype=torch.int32),
                            torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0.25)
    assert out.shape == (0, 2, 16)


@pytest.mark.skipif(INTERPRETER_HERE, reason="CPU tensors are served here: Triton runs its interpreter")
def test_cpu_tensors_without_the_interpreter_raise_a_clear_error() -> None:
    args = make_batch([(3, 5)], page_size=8, heads=2, kv_heads=1, head_dim=16)
    with pytest.raises(RuntimeError, match="runs on CUDA devices.*TRITON_INTERPRET=1"):
        prefill_attention(*args, 0.25)


def test_switching_the_interpreter_after_triton_was_imported_is_refused(monkeypatch) -> None:
    args = make_batch([(3, 5)], page_size=8, heads=2, kv_heads=1, head_dim=16)
    monkeypatch.setenv("TRITON_INTERPRET", "0" if INTERPRETER_HERE else "1")
    with pytest.raises(RuntimeError, match="when triton was first imported"):
        prefill_attention(*args, 0.25)


def test_rejects_inputs_it_cannot_serve() -> None:
    q, k_cache, v_cache, table, cu, k_lens = make_batch([(3, 5)], page_size=8, heads=4, kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        prefill_attention(q[:, :3], k_cache, v_cache, table, cu, k_lens, 0.25)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        prefill_attention(q.double(), k_cache, v_cache, table, cu, k_lens, 0.25)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        prefill_attention(q, k_cache, v_cache, table, cu[:1], k_lens, 0.25)
    with pytest.raises(ValueError, match="sliding_window"):
        prefill_attention(q, k_cache, v_cache, table, cu, k_lens, 0.25, sliding_window=0)
    with pytest.raises(ValueError, match="power of two"):
        prefill_attention(q, k_cache, v_cache, table, cu, k_lens, 0.25, tiles=PrefillTiles(block_m=24, block_n=16))
    with pytest.raises(ValueError, match="softcap must be None or a positive"):
        prefill_attention(q, k_cache, v_cache, table, cu, k_lens, 0.25, softcap=0.0)
    with pytest.raises(ValueError, match=r"sinks must be a floating-point \[heads=4\]"):
        prefill_attention(q, k_cache, v_cache, table, cu, k_lens, 0.25, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="differ in more than the head dim"):
        prefill_attention(q, k_cache, v_cache[:, :, :1], table, cu, k_lens, 0.25)


# ---- compiled, without a GPU -----------------------------------------------------------------------------------------


@pytest.mark.skipif(INTERPRETER_HERE, reason="Triton's library is built for the interpreter in this process")
@pytest.mark.parametrize(
    ("arch", "dtype", "tiles", "window"),
    [(90, "bf16", PrefillTiles(128, 64, 8, 2), False), (80, "fp32", PrefillTiles(64, 32, 4, 2), True)],
    ids=["sm90-bf16-causal", "sm80-fp32-window-softcap-sinks"],
)
def test_kernel_compiles_for_gpus_without_one(arch, dtype, tiles, window) -> None:
    # Triton compiles ahead of time for a named target with its bundled ptxas; this checks the compiled path (the
    # interpreter tests above never run it) on machines without a GPU. Signature as a launch on contiguous tensors
    # would specialise it: head-dim strides 1, pointers and other strides divisible by 16.
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cbcore.triton_kernels import prefill as module

    kernel = module._jitted_kernel(module.interpreter_enabled())
    names = kernel.arg_names
    constants = dict(GROUP=4, PAGE_SIZE=16, HEAD_DIM=128, BLOCK_D=128, V_HEAD_DIM=128, BLOCK_DV=128,
                     BLOCK_M=tiles.block_m, BLOCK_Q=tiles.block_m // 4, BLOCK_N=tiles.block_n, HAS_WINDOW=window,
                     HAS_SOFTCAP=window, HAS_SINKS=window,
                     DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", BF16_AS_FP32=False,
                     stride_q_dim=1, stride_k_dim=1, stride_v_dim=1, stride_o_dim=1)
    tensors = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")
    signature = {name: "constexpr" if name in constants else f"*{dtype}" if name in tensors
                 else "*fp32" if name == "sinks_ptr" else "*i32" if name.endswith("_ptr")
                 else "fp32" if name in ("qk_scale", "softcap_log2") else "i32" for name in names}
    divisible = [name for name in names
                 if name not in constants and (name.endswith("_ptr") or name.startswith("stride"))]
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(name),): [["tt.divisibility", 16]] for name in divisible})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    ptx = compiled.asm["ptx"]
    assert "cp.async" in ptx, "the K/V loads of the key loop were not software-pipelined"
    if dtype == "bf16":
        assert ("wgmma" if arch >= 90 else "mma.sync") in ptx, "the products do not use tensor cores"


# ---- GPU (compiled) --------------------------------------------------------------------------------------------------

# Realistic mixes: long prompts, chunks after long cached prefixes, decode-like single tokens, page boundaries.
GPU_BATCH = [(1, 2000), (17, 17), (300, 812), (1024, 1024), (64, 4096), (1, 1), (129, 4000)]


@pytest.mark.gpu
@needs_compiled_cuda
@pytest.mark.parametrize(
    ("dtype", "atol"),
    [(torch.bfloat16, 2e-2), (torch.float16, 5e-3), (torch.float32, 1e-4)],
    ids=["bf16", "fp16", "fp32"],
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page_size"),
    [(32, 8, 128, 16), (32, 32, 128, 16), (32, 4, 64, 256), (16, 2, 80, 32)],
    ids=["gqa4-d128-p16", "mha-d128-p16", "gqa8-d64-p256", "gqa8-d80-p32"],
)
@pytest.mark.parametrize("window", [None, 1000], ids=["causal", "window1000"])
def test_gpu_matches_reference(dtype, atol, heads, kv_heads, head_dim, page_size, window) -> None:
    args = make_batch(GPU_BATCH, page_size, heads, kv_heads, head_dim, dtype=dtype, device="cuda", seed=heads)
    assert_matches_reference(args, window, atol=atol, rtol=atol)


@pytest.mark.gpu
@needs_compiled_cuda
@pytest.mark.parametrize("tiles", [PrefillTiles(16, 16), PrefillTiles(64, 32), PrefillTiles(128, 64, 8, 3)],
                         ids=["m16n16", "m64n32", "m128n64"])
def test_gpu_tile_shapes_match_reference(tiles) -> None:
    args = make_batch(GPU_BATCH, 16, 32, 8, 128, dtype=torch.bfloat16, device="cuda", seed=1)
    assert_matches_reference(args, None, atol=2e-2, rtol=2e-2, tiles=tiles)


@pytest.mark.gpu
@needs_compiled_cuda
def test_gpu_small_batch_matches_reference() -> None:
    # The CPU cases, compiled: tiny shapes take code paths (tiles mostly padding) that big ones do not.
    for heads, kv_heads in [(2, 2), (4, 1), (8, 1)]:
        for window in (None, 5):
            args = make_batch(RAGGED, 8, heads, kv_heads, head_dim=16, device="cuda", seed=heads)
            assert_matches_reference(args, window, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@needs_compiled_cuda
@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [None, 1000], ids=["causal", "window1000"])
def test_gpu_softcap_and_sinks_match_reference(dtype, atol, window) -> None:
    args = make_batch(GPU_BATCH, 16, 32, 8, 128, dtype=dtype, device="cuda", seed=2)
    assert_matches_reference(args, window, atol=atol, rtol=atol, softcap=30.0, sinks=sink_logits(32).cuda())


@pytest.mark.gpu
@needs_compiled_cuda
def test_gpu_latent_attention_head_dims_match_reference() -> None:
    # DeepSeek-V3's per-head dims: K 192 (128 + 64 rotary), V 128.
    args = make_batch(GPU_BATCH[:4], 16, 16, 16, 192, dtype=torch.bfloat16, device="cuda", seed=3, v_head_dim=128)
    assert_matches_reference(args, None, atol=2e-2, rtol=2e-2)
