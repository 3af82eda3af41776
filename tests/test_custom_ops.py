"""cbcore's kernels as torch.library custom ops (cbcore/ops/custom_ops.py): each passes `torch.library.opcheck`
(schema, fake implementation, mutation annotations, tracing with dynamic shapes), equals the eager op, and a function
of all three compiles in one graph (no graph break) that does not recompile when the token count changes."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from cbcore import ops
from cbcore.ops import custom_ops  # noqa: F401 - registers torch.ops.cbcore.*

PAGE, BLOCKS, KV_HEADS, HEADS, DIM = 4, 8, 2, 4, 8


def _pages(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(BLOCKS, PAGE, KV_HEADS, DIM, generator=generator),
            torch.randn(BLOCKS, PAGE, KV_HEADS, DIM, generator=generator))


def _decode_inputs(batch: int = 3):
    k_cache, v_cache = _pages()
    q = torch.randn(batch, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    table = torch.arange(batch * 2, dtype=torch.int32).view(batch, 2) % BLOCKS
    lens = torch.tensor([5, 8, 1][:batch] + [3] * max(0, batch - 3), dtype=torch.int32)
    return q, k_cache, v_cache, table, lens


def _prefill_inputs():
    k_cache, v_cache = _pages()
    q = torch.randn(7, HEADS, DIM, generator=torch.Generator().manual_seed(2))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    lens = torch.tensor([5, 7], dtype=torch.int32)
    return q, k_cache, v_cache, table, cu, lens


def test_every_op_passes_opcheck() -> None:
    k_cache, v_cache = _pages()
    k = torch.randn(3, KV_HEADS, DIM)
    v = torch.randn(3, KV_HEADS, DIM)
    torch.library.opcheck(torch.ops.cbcore.cache_write.default, (k, v, k_cache, v_cache, torch.tensor([0, 5, 9])))
    q, kc, vc, table, lens = _decode_inputs()
    torch.library.opcheck(torch.ops.cbcore.decode_attention.default, (q, kc, vc, table, lens, 0.35),
                          {"sliding_window": 4, "softcap": 30.0, "sinks": torch.zeros(HEADS)})
    q, kc, vc, table, cu, lens = _prefill_inputs()
    torch.library.opcheck(torch.ops.cbcore.prefill_attention.default, (q, kc, vc, table, cu, lens, 0.35))


def test_the_ops_equal_the_eager_faces() -> None:
    q, kc, vc, table, lens = _decode_inputs()
    assert torch.equal(torch.ops.cbcore.decode_attention(q, kc, vc, table, lens, 0.35),
                       ops.decode_attention(q, kc, vc, table, lens, 0.35))
    q, kc, vc, table, cu, lens = _prefill_inputs()
    assert torch.equal(torch.ops.cbcore.prefill_attention(q, kc, vc, table, cu, lens, 0.35),
                       ops.prefill_attention(q, kc, vc, table, cu, lens, 0.35))


def _step(k, v, q_decode, q_prefill, k_cache, v_cache, slots, decode_table, decode_lens, prefill_table, cu, lens):
    torch.ops.cbcore.cache_write(k, v, k_cache, v_cache, slots)
    decoded = torch.ops.cbcore.decode_attention(q_decode, k_cache, v_cache, decode_table, decode_lens, 0.35)
    prefilled = torch.ops.cbcore.prefill_attention(q_prefill, k_cache, v_cache, prefill_table, cu, lens, 0.35)
    return torch.cat([decoded, prefilled]) * 2.0


def _step_inputs(prefill_tokens: int):
    k_cache, v_cache = _pages(3)
    generator = torch.Generator().manual_seed(prefill_tokens)
    num_tokens = 2 + prefill_tokens
    k = torch.randn(num_tokens, KV_HEADS, DIM, generator=generator)
    v = torch.randn(num_tokens, KV_HEADS, DIM, generator=generator)
    q_decode = torch.randn(2, HEADS, DIM, generator=generator)
    q_prefill = torch.randn(prefill_tokens, HEADS, DIM, generator=generator)
    slots = torch.cat([torch.tensor([4, 8]), 16 + torch.arange(prefill_tokens)])
    decode_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    decode_lens = torch.tensor([1, 1], dtype=torch.int32)
    prefill_table = torch.tensor([[4, 5]], dtype=torch.int32)
    cu = torch.tensor([0, prefill_tokens], dtype=torch.int32)
    lens = torch.tensor([prefill_tokens], dtype=torch.int32)
    return k, v, q_decode, q_prefill, k_cache, v_cache, slots, decode_table, decode_lens, prefill_table, cu, lens


@pytest.mark.parametrize("prefill_tokens", [3, 6])
def test_a_step_of_the_three_ops_compiles_in_one_graph_and_equals_eager(prefill_tokens: int) -> None:
    eager_inputs = _step_inputs(prefill_tokens)
    compiled_inputs = _step_inputs(prefill_tokens)
    want = _step(*eager_inputs)
    got = torch.compile(_step, fullgraph=True, backend="eager")(*compiled_inputs)  # fullgraph: a break raises
    assert torch.equal(got, want)
    assert torch.equal(compiled_inputs[4], eager_inputs[4]) and torch.equal(compiled_inputs[5], eager_inputs[5])


def test_changing_the_token_count_does_not_recompile() -> None:
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(_step, backend=counter, dynamic=True)
    for prefill_tokens in (3, 5, 6):
        compiled(*_step_inputs(prefill_tokens))
    assert counter.frame_count == 1
