"""Cascade decode (docs/design.md, "The CPU attention kernels"): requests whose block tables start with the same
physical blocks attend to that shared prefix once, as one matrix over all their queries, then each to its own suffix,
merged by the softmax normalisers.

The specification is still the plain decode (`decode_attention_reference`): cascade changes the order of the sums,
never the result beyond rounding. `cascade_decode_reference` is the cascade written in plain torch, held to the plain
reference too. The C++ plan (`_C.plan_decode`) decides the groups; its `cascade_groups` are checked here so that no
case is vacuous (a case meant to cascade really does).

Caches are noise, blocks outside a request's table are noise too, and the shared blocks are the same physical blocks
in every member's table, as prefix sharing leaves them.
"""

from __future__ import annotations

import pytest
import torch

from cbcore import ops

_C = ops.cpu_kernels()
pytestmark = pytest.mark.skipif(_C is None, reason="cbcore._C was built without the CPU attention kernels")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@pytest.fixture(params=ops.cpu_isas())
def isa(request):
    """Each instruction set's copy of the kernels in turn."""
    _C._set_cpu_attention_isa(request.param)
    yield request.param
    _C._set_cpu_attention_isa("auto")


def shared_prefix_batch(prefix_blocks, own_lengths, page_size, kv_heads=2, head_dim=64, seed=0, dtype=torch.float32,
                        heads=8):
    """A batch in which the requests of each group share `prefix_blocks[i]` leading physical blocks.

    own_lengths: per group, the keys each member has after the shared blocks (0 is allowed: the prefix is all it has).
    Groups of one member are requests sharing nothing. Returns q, caches, block table, seq_lens."""
    generator = torch.Generator().manual_seed(seed)
    rows, lens = [], []
    next_block = 0
    for shared, owns in zip(prefix_blocks, own_lengths):
        shared_ids = list(range(next_block, next_block + shared))
        next_block += shared
        for own in owns:
            own_blocks = -(-own // page_size)
            rows.append(shared_ids + list(range(next_block, next_block + own_blocks)))
            next_block += own_blocks
            lens.append(shared * page_size + own)
    num_blocks = next_block + 4
    # Scatter the block ids so that shared blocks are not simply the first ones of the cache.
    perm = torch.randperm(num_blocks, generator=generator)
    width = max(len(r) for r in rows) + 1
    table = torch.randint(0, num_blocks, (len(rows), width), generator=generator, dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, :len(r)] = perm[torch.tensor(r, dtype=torch.long)].to(torch.int32)
    shape = (num_blocks, page_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    q = torch.randn(len(rows), heads, head_dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


def run_both(q, k_cache, v_cache, table, lens, window=None, softcap=None, sinks=None):
    """(cascade kernel, plain kernel, plain reference, the plan's groups)."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    w = -1 if window is None else window
    plan = _C.plan_decode(table, lens, k_cache.shape[0], k_cache.shape[1], kv_heads, heads, w)
    cascade = _C.decode_attention(q, k_cache, v_cache, table, lens, 0.125, w, softcap or 0.0, sinks)
    plain = _C.decode_attention(q, k_cache, v_cache, table, lens, 0.125, w, softcap or 0.0, sinks, cascade=False)
    want = ops.decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), table, lens, 0.125, window,
                                          softcap, sinks)
    return cascade, plain, want, plan.cascade_groups


def assert_close(got, want, dtype=torch.float32):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# ---- the plan: who is grouped -------------------------------------------------------------------------------------


def test_requests_sharing_leading_blocks_form_one_group_with_the_shared_length() -> None:
    q, k, v, table, lens = shared_prefix_batch([4, 0], [[3, 9, 17, 0], [20]], 8)
    _, _, _, groups = run_both(q, k, v, table, lens)
    assert groups == [([0, 1, 2, 3], 32)]


def test_a_member_sharing_fewer_blocks_is_left_out_when_it_would_shrink_the_saving() -> None:
    """Three requests share 6 blocks, a fourth only the first of them: the three form the group, the fourth alone."""
    q, k, v, table, lens = shared_prefix_batch([6], [[5, 5, 5]], 8)
    outlier = table[0].clone()
    outlier[1:] = table[0].max() + 1 + torch.arange(outlier.numel() - 1, dtype=torch.int32)  # fresh blocks
    k = torch.cat([k, torch.randn(outlier.numel(), *k.shape[1:])])
    v = torch.cat([v, torch.randn(outlier.numel(), *v.shape[1:])])
    table = torch.cat([table, outlier[None]])
    lens = torch.cat([lens, torch.tensor([50], dtype=torch.int32)])
    cascade, _, want, groups = run_both(q[[0, 1, 2, 0]].clone(), k, v, table, lens)
    assert groups == [([0, 1, 2], 48)]
    assert_close(cascade, want)


@pytest.mark.parametrize(("prefix_blocks", "members", "heads", "why"), [
    (4, 1, 8, "a group of one saves nothing"),
    (3, 2, 2, "2 members x 1 query head per kv head: too few rows"),
    (1, 8, 8, "8 shared keys: too short a prefix"),
])
def test_no_group_below_the_threshold(prefix_blocks, members, heads, why) -> None:
    q, k, v, table, lens = shared_prefix_batch([prefix_blocks], [[5] * members], 8, heads=heads)
    cascade, _, want, groups = run_both(q, k, v, table, lens)
    assert groups == [], why
    assert_close(cascade, want)


def test_a_sliding_window_that_starts_after_key_0_keeps_a_request_out_of_its_group() -> None:
    """Window 40: the members with 35 and 39 keys see key 0 and are grouped; those with 41 and 60 are not."""
    q, k, v, table, lens = shared_prefix_batch([4], [[3, 7, 9, 28, 2, 5]], 8)  # lens 35 39 41 60 34 37
    cascade, plain, want, groups = run_both(q, k, v, table, lens, window=40)
    assert groups == [([0, 1, 4, 5], 32)]
    assert_close(cascade, want)
    assert_close(plain, want)


def test_cascade_can_be_turned_off_per_plan() -> None:
    q, k, v, table, lens = shared_prefix_batch([4], [[3, 9, 17]], 8)
    plan = _C.plan_decode(table, lens, k.shape[0], 8, 2, 8, -1, cascade=False)
    assert plan.cascade_groups == []


# ---- results: equal to the plain decode ----------------------------------------------------------------------------

GROUP_SIZES = [2, 5, 16, 64]


@pytest.mark.parametrize("members", GROUP_SIZES)
@pytest.mark.parametrize(("page_size", "prefix_blocks"), [(8, 5), (16, 3), (16, 70)],
                         ids=["40-keys", "48-keys", "1120-keys-two-chunks"])
def test_cascade_equals_plain_decode(isa, members, page_size, prefix_blocks) -> None:
    """Prefixes of several pages, one longer than the 1024-key split-K chunk; suffixes from none to several pages."""
    owns = [(7 * i) % (3 * page_size + 1) for i in range(members)]
    q, k, v, table, lens = shared_prefix_batch([prefix_blocks], [owns], page_size, seed=members)
    cascade, plain, want, groups = run_both(q, k, v, table, lens)
    assert groups == [(list(range(members)), prefix_blocks * page_size)]
    assert_close(cascade, want)
    assert_close(plain, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_cascade_equals_plain_decode_in_half_precision(isa, dtype, head_dim) -> None:
    q, k, v, table, lens = shared_prefix_batch([5], [[3, 0, 17, 40, 9]], 8, head_dim=head_dim, dtype=dtype)
    cascade, _, want, groups = run_both(q, k, v, table, lens)
    assert len(groups) == 1
    assert_close(cascade, want, dtype)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("page_size", "prefix_blocks", "trim"), [(16, 3, 0), (16, 70, 0), (256, 2, 0), (16, 5, 7)],
                         ids=["48-keys", "1120-keys-two-chunks", "512-keys", "73-keys-a-partial-group"])
def test_bf16_cascade_on_pages_of_whole_groups_of_sixteen_keys(isa, page_size, prefix_blocks, trim, head_dim,
                                                               with_sinks) -> None:
    """The bf16 prefix in two passes: on AMX CPUs on tiles, with K tiles loaded from the pages, which here hold whole
    groups of 16 keys (cascade_prefix_amx); with AVX512-BF16 alone on vdpbf16ps (cascade_prefix_dpbf16, also
    reached by the other tests' pages of 8). A member that ends `trim` keys before the shared blocks do makes the
    prefix end inside a group of 16, and of 32 (staged, or zero weights past the prefix: those keys never weigh)."""
    owns = [0, 5, 40, 0, 17, 3, 0, 9]
    q, k, v, table, lens = shared_prefix_batch([prefix_blocks], [owns], page_size, head_dim=head_dim,
                                               dtype=torch.bfloat16, seed=prefix_blocks + head_dim)
    lens[0] -= trim
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3)) * 2 if with_sinks else None
    cascade, _, want, groups = run_both(q, k, v, table, lens, sinks=sinks)
    assert groups == [(list(range(len(owns))), prefix_blocks * page_size - trim)]
    assert_close(cascade, want, torch.bfloat16)


def test_mixed_groups_and_loners(isa) -> None:
    """Two groups of different prefixes, requests sharing nothing, in one batch."""
    q, k, v, table, lens = shared_prefix_batch([6, 0, 9, 0], [[1, 30, 4], [12], [2, 2, 2, 2, 50], [70]], 8)
    cascade, _, want, groups = run_both(q, k, v, table, lens)
    assert groups == [([0, 1, 2], 48), ([4, 5, 6, 7, 8], 72)]
    assert_close(cascade, want)


@pytest.mark.parametrize(("softcap", "with_sinks"), [(0.7, False), (None, True), (0.7, True)])
def test_cascade_with_softcap_and_sinks(isa, softcap, with_sinks) -> None:
    """The sink joins each request's softmax once (through its shared prefix's part), soft-capping every part."""
    q, k, v, table, lens = shared_prefix_batch([70, 4], [[3, 0, 17], [9, 9, 9, 9]], 16)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2)) * 2 if with_sinks else None
    cascade, _, want, groups = run_both(q, k, v, table, lens, softcap=softcap, sinks=sinks)
    assert len(groups) == 2
    assert_close(cascade, want)


def test_cascade_with_a_window_longer_than_every_request(isa) -> None:
    q, k, v, table, lens = shared_prefix_batch([5], [[3, 8, 17]], 8)
    cascade, _, want, groups = run_both(q, k, v, table, lens, window=1000)
    assert len(groups) == 1
    assert_close(cascade, want)


def test_planned_cascade_equals_the_unplanned_call() -> None:
    """The per-step plan (built once, reused by every layer) gives what a one-off call gives, bitwise."""
    q, k, v, table, lens = shared_prefix_batch([5], [[3, 8, 17, 1]], 8)
    plan = _C.plan_decode(table, lens, k.shape[0], 8, 2, 8, -1)
    out = torch.empty(4, 8, 64)
    for _ in range(2):  # two layers
        _C.decode_attention_planned(plan, q, k, v, 0.125, 0.0, None, out)
        assert torch.equal(out, _C.decode_attention(q, k, v, table, lens, 0.125, -1))


# ---- the plain-torch cascade ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("window", "softcap", "with_sinks"), [(None, None, False), (100, 0.7, True)])
def test_cascade_reference_equals_plain_reference(window, softcap, with_sinks) -> None:
    q, k, v, table, lens = shared_prefix_batch([6, 0, 4], [[1, 30, 0], [12], [2, 2, 5]], 8)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3)) if with_sinks else None
    groups = _C.plan_decode(table, lens, k.shape[0], 8, 2, 8, -1 if window is None else window).cascade_groups
    assert len(groups) == 2
    got = ops.cascade_decode_reference(q, k, v, table, lens, groups, 0.125, window, softcap, sinks)
    want = ops.decode_attention_reference(q, k, v, table, lens, 0.125, window, softcap, sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- the engine's step ---------------------------------------------------------------------------------------------


def test_the_step_plans_cascade_for_a_w2_like_batch() -> None:
    """64 requests sharing a 512-token prefix (two 256-token pages, the default page size) and 16-64 own tokens: the
    step's plan, built once by StepKernelPlans for every layer, holds one group of all 64."""
    generator = torch.Generator().manual_seed(5)
    owns = torch.randint(16, 65, (64,), generator=generator).tolist()
    q, k, v, table, lens = shared_prefix_batch([2], [owns], 256, kv_heads=4, heads=8)
    plans = ops.StepKernelPlans()
    plan = plans.decode(table, lens, k, q.shape[1], -1)
    assert plan.cascade_groups == [(list(range(64)), 512)]
    assert plans.decode(table, lens, k, q.shape[1], -1) is plan  # the other layers reuse it
    out = torch.empty(64, 8, 64)
    ops.decode_attention(q, k, v, table, lens, 0.125, mode="cpu", plans=plans, out=out)
    assert_close(out, ops.decode_attention_reference(q, k, v, table, lens, 0.125))


def test_the_switch_turns_the_step_plans_cascade_off(monkeypatch) -> None:
    """CBCORE_CASCADE_DECODE=0: the W2-like batch's step plan holds no group (every request attends its prefix
    itself), with the same output; a value neither on nor off raises, naming the variable."""
    generator = torch.Generator().manual_seed(5)
    owns = torch.randint(16, 65, (64,), generator=generator).tolist()
    q, k, v, table, lens = shared_prefix_batch([2], [owns], 256, kv_heads=4, heads=8)
    monkeypatch.setenv(ops.CASCADE_ENV, "0")
    plans = ops.StepKernelPlans()
    assert plans.decode(table, lens, k, q.shape[1], -1).cascade_groups == []
    out = torch.empty(64, 8, 64)
    ops.decode_attention(q, k, v, table, lens, 0.125, mode="cpu", plans=plans, out=out)
    assert_close(out, ops.decode_attention_reference(q, k, v, table, lens, 0.125))
    monkeypatch.setenv(ops.CASCADE_ENV, "sometimes")
    with pytest.raises(ValueError, match=ops.CASCADE_ENV):
        ops.StepKernelPlans().decode(table, lens, k, q.shape[1], -1)


def test_a_bad_cascade_switch_fails_the_engine_build(monkeypatch) -> None:
    """The engine reads the switch once, when it is built (ModelRunner), and carries it on every step's metadata: a
    value neither on nor off is refused then, before any request runs, not by every step."""
    import cbcore
    from conftest import greedy_config, tiny_model

    monkeypatch.setenv(ops.CASCADE_ENV, "sometimes")
    manager = cbcore.ContinuousBatchingManager(tiny_model("llama_gqa"), greedy_config(4))
    with pytest.raises(ValueError, match=ops.CASCADE_ENV):
        manager.warmup()


@pytest.mark.parametrize("cascade", ["1", "0"], ids=["cascade", "plain"])
def test_engine_with_cascade_gives_model_generate_tokens(monkeypatch, cascade) -> None:
    """Eight prompts sharing a 40-token prefix (five pages of 8, shared by prefix caching) and their own 3-10 tokens:
    the decode steps cascade (recorded from the step plans; none with CBCORE_CASCADE_DECODE=0), and every request's
    greedy tokens equal `model.generate` on its prompt alone."""
    import cbcore
    from conftest import greedy_config, random_prompts, reference_tokens, run_engine, tiny_model

    model = tiny_model("llama_gqa")
    prefix = random_prompts([40], seed=21)[0]
    prompts = [prefix + own for own in random_prompts([3, 5, 7, 10, 4, 6, 8, 9], seed=22)]
    seen: list = []
    original = ops.StepKernelPlans.decode

    def recording(self, *args, **kwargs):
        plan = original(self, *args, **kwargs)
        seen.append(plan.cascade_groups)
        return plan

    monkeypatch.setattr(ops.StepKernelPlans, "decode", recording)
    monkeypatch.setenv("CBCORE_KERNELS", "cpu")
    monkeypatch.setenv(ops.CASCADE_ENV, cascade)
    generation = greedy_config(8)
    outputs, _ = run_engine(model, prompts, generation, cbcore.ContinuousBatchingConfig(page_size=8))
    if cascade == "1":
        assert any(groups and len(groups[0][0]) >= 4 and groups[0][1] == 40 for groups in seen), seen
    else:
        assert seen and not any(seen), seen
    for prompt, output in zip(prompts, outputs.values()):
        assert output.generated_tokens == reference_tokens(model, prompt, generation)
