"""The CUDA decode kernels' logic, checked on a machine without a GPU.

tests/cuda_emulation/ holds a stand-in for the CUDA runtime (a std::thread per CUDA thread, barriers for
__syncthreads and the warp shuffles); the real kernel header csrc/attention/cuda_decode_attention.cuh and the real
launch plan (cuda_decode_params.h) are compiled against it with the host compiler and run on small batches, against
the reference in cbcore/ops/reference.py. This covers the indexing through block tables, head grouping and padding, the
butterfly reductions, split-K and its merge, sliding windows, soft-capping, attention sinks (counted once across
split-K), a V head dim of its own (K 192 / V 128) and the deterministic mode's batch independence. It
does not cover what only a GPU shows (the memory model, the 16-byte load instruction, performance): that is
tests/test_kernels_cuda.py's job, under `pytest -m gpu`.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from cbcore import ops

ROOT = Path(__file__).resolve().parents[1]
EMULATION = Path(__file__).resolve().parent / "cuda_emulation"
KERNELS = ROOT / "csrc" / "attention" / "cuda_decode_attention.cuh"
SMEM_LINE = "extern __shared__ __align__(16) float smem[];"
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}
TARGET_CTAS = 8 * 132  # the plan an H200 gets in the default mode

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or not KERNELS.exists(), reason="needs g++ and the sources")


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    """The emulation harness, built once per test run (a few seconds)."""
    build = tmp_path_factory.mktemp("cuda_emulation")
    source = KERNELS.read_text(encoding="utf-8")
    assert source.count(SMEM_LINE) == 1, f"the kernel header no longer has exactly one `{SMEM_LINE}`"
    (build / "kernel_patched.cuh").write_text(source.replace(SMEM_LINE, "float* smem = emu_smem_buffer;"))
    binary = build / "harness"
    command = ["g++", "-std=c++20", "-O1", "-pthread", f"-I{build}", f"-I{EMULATION}", f"-I{ROOT / 'csrc'}",
               str(EMULATION / "harness.cpp"), "-o", str(binary)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return binary


def paged(lengths, num_heads, num_kv_heads, head_dim, page_size, dtype, seed=0, v_head_dim=None):
    generator = torch.Generator().manual_seed(seed)
    blocks = [-(-n // page_size) for n in lengths]
    num_blocks = sum(blocks) + 2
    k_cache = torch.randn(num_blocks, page_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, page_size, num_kv_heads, v_head_dim or head_dim, generator=generator).to(dtype)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    table = torch.zeros(len(lengths), max(max(blocks), 1), dtype=torch.int32)
    start = 0
    for i, count in enumerate(blocks):
        table[i, :count] = order[start:start + count]
        start += count
    return q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32)


def emulate(harness: Path, q, k_cache, v_cache, table, seq_lens, window=-1, deterministic=False,
            target_ctas=TARGET_CTAS, softcap=None, sinks=None) -> tuple[torch.Tensor, str]:
    """The kernels' output for these inputs, and the launch plan they ran with."""
    batch, num_heads, head_dim = q.shape
    num_blocks, page_size, num_kv_heads, _ = k_cache.shape
    work = harness.parent / "io"
    work.mkdir(exist_ok=True)
    for name, tensor in [("q", q), ("k", k_cache), ("v", v_cache), ("table", table), ("lens", seq_lens)]:
        tensor.contiguous().view(torch.uint8).numpy().tofile(work / f"{name}.bin")
    (work / "sinks.bin").unlink(missing_ok=True)  # the harness reads sinks when the file exists
    if sinks is not None:
        sinks.float().contiguous().numpy().tofile(work / "sinks.bin")
    dtype = "f32" if q.dtype == torch.float32 else "bf16"
    args = [str(harness), str(work), dtype, *map(str, (batch, num_heads, num_kv_heads, head_dim, page_size,
                                                      table.shape[1], num_blocks, window, int(deterministic),
                                                      target_ctas)), repr(1 / math.sqrt(head_dim)),
            repr(float(softcap or 0.0)), str(v_cache.shape[3])]
    result = subprocess.run(args, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    raw = torch.from_numpy(np.fromfile(work / "out.bin", dtype=np.uint8))
    return raw.view(q.dtype).view(batch, num_heads, v_cache.shape[3]), result.stderr.strip()


def check_against_reference(harness, lengths, num_heads, num_kv_heads, head_dim, page_size, dtype, window=-1,
                            deterministic=False, target_ctas=TARGET_CTAS, softcap=None, sinks=None,
                            v_head_dim=None) -> str:
    q, k_cache, v_cache, table, seq_lens = paged(lengths, num_heads, num_kv_heads, head_dim, page_size, dtype,
                                                 v_head_dim=v_head_dim)
    out, plan = emulate(harness, q, k_cache, v_cache, table, seq_lens, window, deterministic, target_ctas, softcap,
                        sinks)
    ref = ops.decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), table, seq_lens,
                                         1 / math.sqrt(head_dim), None if window == -1 else window, softcap, sinks)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol, msg=lambda m: f"{m}\n{plan}")
    return plan


RAGGED = [1, 7, 8, 9, 16, 17, 100, 301]


@pytest.mark.parametrize(
    ("dtype", "head_dim", "num_heads", "num_kv_heads", "page_size"),
    [
        (torch.float32, 64, 8, 8, 8),  # no grouping
        (torch.bfloat16, 128, 16, 4, 16),  # GQA 4
        (torch.float32, 256, 32, 4, 256),  # GQA 8, pages larger than a split
        (torch.float32, 128, 28, 4, 8),  # GQA 7: one padded head
        (torch.bfloat16, 64, 16, 1, 16),  # GQA 16: two head chunks per kv head
    ],
    ids=["gqa1-f32-d64-p8", "gqa4-bf16-d128-p16", "gqa8-f32-d256-p256", "gqa7-f32-d128-p8", "gqa16-bf16-d64-p16"],
)
def test_emulated_decode_matches_reference(harness, dtype, head_dim, num_heads, num_kv_heads, page_size) -> None:
    plan = check_against_reference(harness, RAGGED, num_heads, num_kv_heads, head_dim, page_size, dtype)
    assert "max_splits=1 " not in plan, "the ragged batch must exercise split-K"


@pytest.mark.parametrize("window", [1, 5, 64])
def test_emulated_decode_sliding_window(harness, window) -> None:
    check_against_reference(harness, [1, 9, 33, 700], 8, 2, 64, 8, torch.float32, window=window)


def test_emulated_split_k_with_the_largest_and_smallest_splits(harness) -> None:
    assert "split=1024 " in check_against_reference(harness, [2500, 3], 4, 1, 64, 16, torch.float32, target_ctas=1)
    assert "split=64 " in check_against_reference(harness, [1500, 5], 4, 1, 64, 16, torch.float32,
                                                  target_ctas=10**6)


def test_emulated_deterministic_mode_is_independent_of_the_batch(harness) -> None:
    lengths = [1300, 1, 260]
    q, k_cache, v_cache, table, seq_lens = paged(lengths, 8, 2, 64, 16, torch.bfloat16, seed=3)
    full, plan = emulate(harness, q, k_cache, v_cache, table, seq_lens, deterministic=True)
    assert "split=256 " in plan
    for i, length in enumerate(lengths):
        width = -(-length // 16)
        alone, _ = emulate(harness, q[i:i + 1], k_cache, v_cache, table[i:i + 1, :width], seq_lens[i:i + 1],
                           deterministic=True, target_ctas=1)
        assert torch.equal(alone[0], full[i]), f"request {i} differs when it runs alone"


def sink_logits(num_heads: int, seed: int = 0) -> torch.Tensor:
    """Sink logits about the size of the scores, so each takes a real share of its softmax."""
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize(("softcap", "with_sinks"), [(0.7, False), (None, True), (0.7, True)],
                         ids=["softcap", "sinks", "softcap+sinks"])
@pytest.mark.parametrize(
    ("dtype", "head_dim", "num_heads", "num_kv_heads", "page_size"),
    [(torch.float32, 64, 8, 2, 8), (torch.bfloat16, 128, 16, 4, 16), (torch.float32, 128, 28, 4, 8)],
    ids=["gqa4-f32-d64-p8", "gqa4-bf16-d128-p16", "gqa7-f32-d128-p8"],
)
def test_emulated_decode_softcap_and_sinks(harness, softcap, with_sinks, dtype, head_dim, num_heads, num_kv_heads,
                                           page_size) -> None:
    """The ragged batch has one-split and many-split requests: the sink joins once, in the direct write or the merge."""
    sinks = sink_logits(num_heads) if with_sinks else None
    plan = check_against_reference(harness, RAGGED, num_heads, num_kv_heads, head_dim, page_size, dtype,
                                   softcap=softcap, sinks=sinks)
    assert "max_splits=1 " not in plan, "the ragged batch must exercise split-K"


@pytest.mark.parametrize("window", [1, 5, 64])
def test_emulated_decode_sinks_with_a_sliding_window(harness, window) -> None:
    check_against_reference(harness, [1, 9, 33, 700], 8, 2, 64, 8, torch.float32, window=window, softcap=2.0,
                            sinks=sink_logits(8, seed=1))


def test_emulated_decode_sinks_with_the_smallest_splits(harness) -> None:
    """Many splits per request (64 keys each): the merge adds the sink to the total exactly once."""
    assert "split=64 " in check_against_reference(harness, [1500, 5], 4, 1, 64, 16, torch.float32,
                                                  target_ctas=10**6, sinks=sink_logits(4, seed=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (16, 2)], ids=["mla-gqa1", "gqa8"])
def test_emulated_decode_latent_attention_head_dims(harness, dtype, num_heads, num_kv_heads) -> None:
    """DeepSeek-V3's per-head dims: K 192 (read by 16 lanes x 3 vectors in fp32, 8 x 3 in bf16), V 128 (its own lane
    mapping in phase 3); one-split and many-split requests, with sinks."""
    plan = check_against_reference(harness, RAGGED, num_heads, num_kv_heads, 192, 16, dtype, v_head_dim=128,
                                   sinks=sink_logits(num_heads, seed=3))
    assert "max_splits=1 " not in plan
