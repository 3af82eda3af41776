"""The prepacked oneDNN linear layers (cbcore/linear.py): used only inside cbcore's steps, removed at stop, refreshed
when a weight changes in place, switchable off, and numerically a plain linear."""

from __future__ import annotations

import copy

import pytest
import torch

import cbcore
from cbcore.attention import paged_step
from cbcore.linear import PACKED_LINEAR_ENV, PackedLinears
from cbcore.linear_backends import onednn_packs, packing_available
from tests.conftest import assert_engine_clean, collect_outputs, greedy_config, random_prompts, reference_tokens, run_engine, tiny_model

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear ops")


def _packs_here(dtype: torch.dtype) -> bool:
    """Whether this CPU packs weights of `dtype`: the skinny matmul (AVX2 at least) or oneDNN (bf16: AVX-512)."""
    from cbcore import _C

    return _C.skinny_available(dtype) or onednn_packs(dtype)


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_inside_a_step_only(dtype, tolerance, bias) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=bias)).to(dtype)
    x = torch.randn(1, 37, 64, dtype=dtype)
    expected = torch.nn.functional.linear(x, layer[0].weight, layer[0].bias)
    packed = PackedLinears.attach(layer)
    if packed is None and not _packs_here(dtype):
        pytest.skip(f"neither the skinny matmul nor oneDNN packs {dtype} on this CPU: F.linear runs")
    assert packed is not None and packed.modules == [layer[0]]
    with paged_step():
        inside = layer(x)
    assert torch.allclose(inside.float(), expected.float(), rtol=tolerance, atol=tolerance)
    assert torch.equal(layer(x), expected)  # outside a step: the module's own forward, bit for bit
    packed.detach()
    assert "forward" not in layer[0].__dict__ and not hasattr(layer[0], "_cbcore_member")


def test_manager_packs_at_start_and_restores_at_stop() -> None:
    model = tiny_model("llama_gqa")
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(4), cbcore.ContinuousBatchingConfig(page_size=8))
    assert all("forward" not in m.__dict__ for m in _linears(model))  # built, not started: untouched
    manager.start()
    try:
        assert all("forward" in m.__dict__ for m in _linears(model))
        # A forward of the user's own on this thread is not a cbcore step: plain F.linear, same logits as before.
        prompt = torch.tensor([random_prompts([9], seed=3)[0]])
        with torch.no_grad():
            during = model(prompt).logits
    finally:
        manager.stop(block=True, timeout=60)
    assert all("forward" not in m.__dict__ for m in _linears(model))
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, during)


@pytest.mark.parametrize("how", ["in_place", "replaced", "storage_swapped"])
def test_weights_changed_during_a_pause_are_repacked(how) -> None:
    """In place (the op sees the version counters move), replaced by new parameters, or the same parameters given
    another storage (`param.data = ...`, as model.to() does), weights and biases (the engine notices the last two when
    the pause is released and packs them again)."""
    model = copy.deepcopy(tiny_model("qwen2"))  # q/k/v have biases: merged, with a concatenated bias
    prompts = random_prompts([7, 12], seed=5)
    # Fresh prompts after the update: K/V cached for the old weights would be reused by a prefix hit.
    new_prompts = random_prompts([9, 14], seed=6)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(6), cbcore.ContinuousBatchingConfig(page_size=8))
    manager.start()
    try:
        collect_outputs(manager, manager.add_requests(prompts))
        with manager.pause(), torch.no_grad():
            for module in _linears(model):
                if how == "in_place":  # as an optimizer step would
                    module.weight.mul_(-1.5)
                    if module.bias is not None:
                        module.bias.add_(0.5)
                elif how == "replaced":  # as loading another checkpoint into the modules would
                    module.weight = torch.nn.Parameter(module.weight * -1.5)
                    if module.bias is not None:
                        module.bias = torch.nn.Parameter(module.bias + 0.5)
                else:
                    module.weight.data = module.weight.data * -1.5
                    if module.bias is not None:
                        module.bias.data = module.bias.data + 0.5
        request_ids = manager.add_requests(new_prompts)
        outputs = collect_outputs(manager, request_ids)
    finally:
        manager.stop(block=True, timeout=60)
    got = [outputs[rid].generated_tokens for rid in request_ids]
    assert got == [reference_tokens(model, p, greedy_config(6)) for p in new_prompts]


def test_packing_can_be_turned_off_and_a_bad_value_raises(monkeypatch) -> None:
    model = tiny_model("llama_gqa")
    monkeypatch.setenv(PACKED_LINEAR_ENV, "0")
    assert PackedLinears.attach(model) is None
    prompts = random_prompts([10, 5], seed=7)
    outputs, _ = run_engine(model, prompts, greedy_config(5), cbcore.ContinuousBatchingConfig(page_size=4))
    assert [o.generated_tokens for o in outputs.values()] == [reference_tokens(model, p, greedy_config(5)) for p in prompts]
    monkeypatch.setenv(PACKED_LINEAR_ENV, "maybe")
    with pytest.raises(ValueError, match=PACKED_LINEAR_ENV):
        PackedLinears.attach(model)


@pytest.mark.parametrize("offload", [0, 0.01])  # without and with a host pool (10 MiB), so the host tier too
def test_prefix_cache_is_not_shared_across_a_weight_change(offload) -> None:
    """The same prompts after an in-place update inside a pause must be computed with the new weights, not served
    from K/V cached (on the device or in the host tier) under the old ones."""
    model = copy.deepcopy(tiny_model("llama_gqa"))
    prompts = random_prompts([21, 26, 30], seed=11)
    config = cbcore.ContinuousBatchingConfig(page_size=4, cpu_offload_space=offload)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(5), config)
    manager.start()
    try:
        collect_outputs(manager, manager.add_requests(prompts))
        before = manager.stats()["prefix_hit_tokens"]
        with manager.pause(), torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(3.0)  # one in-place update is enough
        request_ids = manager.add_requests(prompts)
        outputs = collect_outputs(manager, request_ids)
        after = manager.stats()["prefix_hit_tokens"]
    finally:
        manager.stop(block=True, timeout=60)
    assert_engine_clean(manager)
    assert after == before, "a prefix cached under the old weights was shared"
    got = [outputs[rid].generated_tokens for rid in request_ids]
    assert got == [reference_tokens(model, p, greedy_config(5)) for p in prompts]


class _ScaledHead(torch.nn.Linear):
    """A linear subclass whose forward does more than F.linear (a learned logit scale, as some LM heads have)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = torch.nn.Parameter(torch.tensor(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class _Router(torch.nn.Linear):
    """A linear subclass returning a tuple, as MoE routers do."""

    def forward(self, x: torch.Tensor):
        logits = super().forward(x)
        return logits, logits.softmax(-1)


def test_only_exact_linear_modules_are_packed_never_subclasses() -> None:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"plain": torch.nn.Linear(16, 8), "head": _ScaledHead(16, 8), "router": _Router(16, 4)})
    x = torch.randn(3, 16)
    head_expected, router_expected = model["head"](x), model["router"](x)
    packed = PackedLinears.attach(model)
    try:
        assert packed is not None and packed.modules == [model["plain"]]
        with paged_step():
            assert torch.equal(model["head"](x), head_expected)  # the scale is kept
            logits, probs = model["router"](x)  # still a tuple
        assert torch.equal(logits, router_expected[0]) and torch.equal(probs, router_expected[1])
    finally:
        packed.detach()


def _group_sizes(model: torch.nn.Module) -> dict[str, int]:
    return {name: m._cbcore_member.group.size for name, m in model.named_modules() if hasattr(m, "_cbcore_member")}


def test_projections_reading_one_input_are_merged_into_one_matmul() -> None:
    model = tiny_model("llama_gqa")
    packed = PackedLinears.attach(model)
    try:
        sizes = _group_sizes(model)
        assert sizes["model.layers.0.self_attn.q_proj"] == sizes["model.layers.0.self_attn.v_proj"] == 3
        assert sizes["model.layers.0.mlp.gate_proj"] == sizes["model.layers.0.mlp.up_proj"] == 2
        assert sizes["model.layers.0.self_attn.o_proj"] == sizes["model.layers.0.mlp.down_proj"] == 1
        attn = model.model.layers[0].self_attn
        torch.manual_seed(0)
        x, other = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
        with paged_step():
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            # A member called on another tensor computes the group again for it: exact, only slower.
            k_other, q_again = attn.k_proj(other), attn.q_proj(x)
        for got, module, inp in ((q, attn.q_proj, x), (k, attn.k_proj, x), (v, attn.v_proj, x),
                                 (k_other, attn.k_proj, other), (q_again, attn.q_proj, x)):
            assert torch.allclose(got, torch.nn.functional.linear(inp, module.weight, module.bias), atol=1e-5)
    finally:
        packed.detach()
    assert not any(hasattr(m, "_cbcore_member") for m in model.modules())


def test_merging_can_be_turned_off_and_unlike_siblings_stay_alone(monkeypatch) -> None:
    monkeypatch.setenv("CBCORE_MERGED_LINEAR", "0")
    model = tiny_model("qwen2")
    packed = PackedLinears.attach(model)
    try:
        assert set(_group_sizes(model).values()) == {1}
    finally:
        packed.detach()
    monkeypatch.delenv("CBCORE_MERGED_LINEAR")
    # q/k/v with different input sizes (as no real model has) are not merged.
    block = torch.nn.Module()
    block.q_proj, block.k_proj, block.v_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), torch.nn.Linear(6, 4)
    packed = PackedLinears.attach(block)
    try:
        assert set(_group_sizes(block).values()) == {1}
    finally:
        packed.detach()


def _count_packs(monkeypatch) -> list[int]:
    """Record the handles the C++ op is asked to pack from now on."""
    from cbcore import _C

    packed: list[int] = []
    register = _C.register_packed_linear

    def counting(handle, *args, **kwargs):
        packed.append(handle)
        return register(handle, *args, **kwargs)

    monkeypatch.setattr(_C, "register_packed_linear", counting)
    return packed


def _serve(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    outputs, manager = run_engine(model, prompts, greedy_config(5), cbcore.ContinuousBatchingConfig(page_size=8))
    assert_engine_clean(manager)
    return [outputs[rid].generated_tokens for rid in outputs]


@pytest.mark.parametrize("change", ["none", "in_place", "replaced", "storage_swapped"])
def test_the_next_manager_takes_back_the_packed_weights_unless_they_changed(monkeypatch, change) -> None:
    """A manager's packed copies stay parked for the model's next manager (one per generate_batch call): taken back
    as they are, repacked by the op after an in-place change (version counters), packed again after a weight was
    replaced by another tensor or its Parameter given another storage (`param.data = ...`, as model.to() does)."""
    from cbcore.linear import _members

    model = copy.deepcopy(tiny_model("qwen2"))  # merged q/k/v with biases
    prompts = random_prompts([7, 12], seed=8)
    packed = _count_packs(monkeypatch)
    first = _serve(model, prompts)
    if not packed:
        pytest.skip("nothing is packed on this CPU")
    assert first == [reference_tokens(model, p, greedy_config(5)) for p in prompts]
    before = len(packed)
    module = model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        if change == "in_place":
            module.weight.mul_(-2.0)
        elif change == "replaced":
            module.weight = torch.nn.Parameter(module.weight * -2.0)
        elif change == "storage_swapped":
            module.weight.data = module.weight.data * -2.0
    expected = [reference_tokens(model, p, greedy_config(5)) for p in prompts]
    assert (expected == first) == (change == "none")  # the change shows in the tokens (else nothing is tested)
    assert _serve(model, prompts) == expected
    repacked = [_members[module].group.handle] if change in ("replaced", "storage_swapped") else []
    assert packed[before:] == repacked


def test_parked_packs_are_freed_on_request_at_detach_when_asked_and_with_the_model(monkeypatch) -> None:
    import gc

    from cbcore.linear import KEEP_PACKED_ENV, _members, release_packed

    model = copy.deepcopy(tiny_model("llama_gqa"))
    prompts = random_prompts([9], seed=9)
    packed = _count_packs(monkeypatch)
    _serve(model, prompts)
    if not packed:
        pytest.skip("nothing is packed on this CPU")
    first = len(packed)
    _serve(model, prompts)
    assert len(packed) == first  # taken back
    assert release_packed(model) == first and release_packed(model) == 0
    _serve(model, prompts)
    assert len(packed) == 2 * first  # freed, so packed again
    cbcore.enable(model).destroy_cached_continuous_batching_manager()  # frees them too
    assert release_packed(model) == 0

    monkeypatch.setenv(KEEP_PACKED_ENV, "0")  # freed at every detach
    _serve(model, prompts)
    assert len(packed) == 3 * first and release_packed(model) == 0
    monkeypatch.delenv(KEEP_PACKED_ENV)

    _serve(model, prompts)  # parked again; the model's garbage collection frees the op's copies
    finalizers = [_members[module].group.finalizer for module in model.modules() if module in _members]
    assert finalizers and all(f.alive for f in finalizers)
    del model
    gc.collect()
    assert not any(f.alive for f in finalizers)
