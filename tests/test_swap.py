"""The host swap pool (cbcore._C.SwapPool, csrc/swap): blocks copied out to the host and back in at other ids come
back bit for bit, many blocks of every layer move in one call, and bad ids raise before anything is copied.

These run on CPU caches (a parallel memcpy); tests/test_kernels_cuda.py repeats the round trip on CUDA caches.
"""

from __future__ import annotations

import pytest
import torch

from cbcore import _C

NUM_LAYERS, NUM_BLOCKS, PAGE_SIZE, KV_HEADS, HEAD_DIM = 3, 12, 4, 2, 8


def make_caches(dtype: torch.dtype = torch.float32, num_layers: int = NUM_LAYERS, num_blocks: int = NUM_BLOCKS,
                seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V caches filled with distinct random values."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    keys = [torch.randn(shape, generator=generator).to(dtype) for _ in range(num_layers)]
    values = [torch.randn(shape, generator=generator).to(dtype) for _ in range(num_layers)]
    return keys, values


def make_pool(num_host_blocks: int = 8, dtype: torch.dtype = torch.float32, num_layers: int = NUM_LAYERS
              ) -> _C.SwapPool:
    return _C.SwapPool(num_layers, num_host_blocks, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_swapped_out_and_in_at_other_ids_come_back_unchanged(dtype: torch.dtype) -> None:
    keys, values = make_caches(dtype)
    pool = make_pool(dtype=dtype)
    device_out, host = [1, 4, 7], [5, 0, 2]
    saved = [(k[device_out].clone(), v[device_out].clone()) for k, v in zip(keys, values)]

    pool.swap_out(keys, values, device_out, host)
    for k, v in zip(keys, values):  # scribble over the originals
        k.fill_(-7)
        v.fill_(13)
    device_in = [9, 3, 11]
    pool.swap_in(keys, values, host, device_in)
    pool.synchronize()

    for layer, (k, v) in enumerate(zip(keys, values)):
        assert torch.equal(k[device_in], saved[layer][0])
        assert torch.equal(v[device_in], saved[layer][1])
        untouched = [b for b in range(NUM_BLOCKS) if b not in device_in]
        assert bool((k[untouched] == -7).all()) and bool((v[untouched] == 13).all())


def test_swap_out_fills_the_named_host_blocks_of_every_layer() -> None:
    keys, values = make_caches()
    pool = make_pool()
    pool.swap_out(keys, values, torch.tensor([2, 6]), torch.tensor([7, 3]))
    for layer in range(NUM_LAYERS):
        assert torch.equal(pool.key(layer)[7], keys[layer][2])
        assert torch.equal(pool.key(layer)[3], keys[layer][6])
        assert torch.equal(pool.value(layer)[7], values[layer][2])
        assert torch.equal(pool.value(layer)[3], values[layer][6])
        others = [b for b in range(8) if b not in (7, 3)]
        assert not pool.key(layer)[others].any(), "blocks that were not named must stay as they were (zero)"


def test_many_blocks_across_all_layers_move_in_one_call() -> None:
    num_layers, num_blocks = 6, 64
    keys, values = make_caches(num_layers=num_layers, num_blocks=num_blocks, seed=3)
    pool = _C.SwapPool(num_layers, num_blocks, PAGE_SIZE, KV_HEADS, HEAD_DIM, torch.float32)
    permutation = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
    pool.swap_out(keys, values, torch.arange(num_blocks), permutation)
    for layer in range(num_layers):
        assert torch.equal(pool.key(layer)[permutation], keys[layer])
        assert torch.equal(pool.value(layer)[permutation], values[layer])

    fresh_keys, fresh_values = make_caches(num_layers=num_layers, num_blocks=num_blocks, seed=4)
    pool.swap_in(fresh_keys, fresh_values, permutation, torch.arange(num_blocks))
    for layer in range(num_layers):
        assert torch.equal(fresh_keys[layer], keys[layer])
        assert torch.equal(fresh_values[layer], values[layer])


def test_ids_may_be_lists_or_int32_or_int64_tensors() -> None:
    keys, values = make_caches()
    pool = make_pool()
    pool.swap_out(keys, values, [0], torch.tensor([1], dtype=torch.int32))
    pool.swap_out(keys, values, torch.tensor([5], dtype=torch.int64), [2])
    assert torch.equal(pool.key(0)[1], keys[0][0])
    assert torch.equal(pool.key(0)[2], keys[0][5])


def test_empty_id_lists_copy_nothing() -> None:
    keys, values = make_caches()
    pool = make_pool()
    pool.swap_out(keys, values, [], [])
    pool.swap_in(keys, values, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert not any(pool.key(layer).any() for layer in range(NUM_LAYERS))


def test_pool_reports_its_layout_and_is_plain_memory_without_cuda() -> None:
    pool = make_pool(num_host_blocks=5, dtype=torch.bfloat16)
    assert (pool.num_layers, pool.num_host_blocks, pool.block_shape, pool.dtype) == (
        NUM_LAYERS, 5, [PAGE_SIZE, KV_HEADS, HEAD_DIM], torch.bfloat16)
    assert pool.nbytes == 2 * NUM_LAYERS * 5 * PAGE_SIZE * KV_HEADS * HEAD_DIM * 2
    assert pool.key(0).shape == (5, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    assert pool.pinned == torch.cuda.is_available()
    assert pool.query()
    pool.wait_on_current_stream()  # nothing was issued: a no-op
    assert "num_host_blocks=5" in repr(pool)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works when a CUDA device is present")
def test_asking_to_pin_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="pin=True needs a CUDA device"):
        _C.SwapPool(1, 1, PAGE_SIZE, KV_HEADS, HEAD_DIM, torch.float32, pin=True)


@pytest.mark.parametrize(
    ("device_ids", "host_ids", "error", "message"),
    [
        ([1, 12], [0, 1], IndexError, r"device_block_ids\[1\] = 12 is out of range \[0, 12\)"),
        ([1, -1], [0, 1], IndexError, r"device_block_ids\[1\] = -1 is out of range"),
        ([1, 2], [0, 8], IndexError, r"host_block_ids\[1\] = 8 is out of range \[0, 8\)"),
        ([1, 2], [3, 3], ValueError, r"block 3 appears twice in host_block_ids \(positions 0 and 1\)"),
        ([1, 2, 3], [0, 1], ValueError, r"device_block_ids has 3 ids but host_block_ids has 2"),
        (torch.tensor([[1]]), [0], ValueError, r"device_block_ids must be 1-D"),
        (torch.tensor([1.0]), [0], TypeError, r"device_block_ids must hold integers"),
        (["a"], [0], TypeError, r"device_block_ids must be a 1-D integer tensor or a list of ints"),
    ],
)
def test_bad_ids_raise_before_anything_is_copied(device_ids, host_ids, error, message) -> None:
    keys, values = make_caches()
    pool = make_pool()
    with pytest.raises(error, match=message):
        pool.swap_out(keys, values, device_ids, host_ids)
    assert not any(pool.key(layer).any() or pool.value(layer).any() for layer in range(NUM_LAYERS))


def test_swap_in_names_its_own_arguments_in_errors() -> None:
    keys, values = make_caches()
    pool = make_pool()
    with pytest.raises(IndexError, match=r"swap_in: host_block_ids\[0\] = 9 is out of range \[0, 8\)"):
        pool.swap_in(keys, values, [9], [0])
    with pytest.raises(ValueError, match=r"swap_in: block 4 appears twice in device_block_ids"):
        pool.swap_in(keys, values, [0, 1], [4, 4])


def test_caches_that_do_not_match_the_pool_are_rejected() -> None:
    keys, values = make_caches()
    pool = make_pool()
    with pytest.raises(ValueError, match="the pool has 3 layers but got 2 key caches and 3 value caches"):
        pool.swap_out(keys[:2], values, [0], [0])
    wrong_shape = [torch.zeros(NUM_BLOCKS, PAGE_SIZE, KV_HEADS, HEAD_DIM * 2)] + keys[1:]
    with pytest.raises(ValueError, match=r"key cache of layer 0 has shape \[12, 4, 2, 16\]"):
        pool.swap_out(wrong_shape, values, [0], [0])
    wrong_dtype = values[:2] + [values[2].to(torch.float16)]
    with pytest.raises(TypeError, match="value cache of layer 2 is Half but the pool holds Float"):
        pool.swap_out(keys, wrong_dtype, [0], [0])
    strided = [k.transpose(1, 2).contiguous().transpose(1, 2) for k in keys]
    with pytest.raises(ValueError, match="key cache of layer 0 is not contiguous"):
        pool.swap_out(strided, values, [0], [0])


def test_copy_blocks_op_is_callable_through_the_dispatcher() -> None:
    source = [torch.arange(24.0).view(6, 4)]
    target = [torch.zeros(3, 4)]
    torch.ops.cbcore.copy_blocks(source, target, torch.tensor([5, 0]), torch.tensor([2, 0]))
    assert torch.equal(target[0], torch.tensor([[0.0, 1, 2, 3], [0, 0, 0, 0], [20, 21, 22, 23]]))
