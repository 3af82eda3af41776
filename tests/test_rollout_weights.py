"""Weight sync on a running manager (cbcore/serving/rollout.py): after `update_weights` / `load_weights`, greedy
tokens equal `model.generate` of the new weights (the prefix cache and the packed linears follow); each pause mode
does what it says to the requests in flight; bad input changes nothing; `reset_prefix_cache` stops sharing."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from conftest import assert_engine_clean, collect_outputs, greedy_config, random_prompts, reference_tokens, tiny_model

import cbcore
from cbcore import RequestStatus


def _model_and_new_weights(seed: int = 0):
    model = copy.deepcopy(tiny_model("qwen2"))
    generator = torch.Generator().manual_seed(seed)
    new = {name: p.detach() + 0.05 * torch.randn(p.shape, generator=generator)
           for name, p in model.named_parameters()}
    return model, new


def _manager(model, max_new_tokens: int = 6) -> cbcore.ContinuousBatchingManager:
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(max_new_tokens),
                                               cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=128))
    manager.start()
    return manager


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_after_an_update_greedy_tokens_equal_generate_of_the_new_weights(mode: str) -> None:
    model, new = _model_and_new_weights()
    prompts = random_prompts([17, 9], seed=3)
    manager = _manager(model)
    try:
        before = collect_outputs(manager, [manager.add_request(p) for p in prompts])  # fills the prefix cache
        in_flight = manager.add_request(prompts[0], max_new_tokens=200)
        assert manager.update_weights(new, mode=mode, timeout=120) == len(new)
        after_ids = [manager.add_request(p) for p in prompts]  # the same prompts: no stale prefix may be shared
        outputs = collect_outputs(manager, [in_flight, *after_ids])
    finally:
        manager.stop(block=True)
    assert_engine_clean(manager)
    for name, tensor in new.items():
        assert torch.equal(dict(model.named_parameters())[name], tensor)
    for prompt, rid in zip(prompts, after_ids):
        assert outputs[rid].generated_tokens == reference_tokens(model, prompt, greedy_config(6))
    status = outputs[in_flight].status
    if mode == "abort":
        assert status == RequestStatus.CANCELLED
    elif mode == "wait":  # it finished on the old weights before the copy
        assert status == RequestStatus.FINISHED and len(outputs[in_flight].generated_tokens) == 200
    else:
        assert status == RequestStatus.FINISHED
    assert len(before) == len(prompts)


def test_bad_weights_are_refused_and_change_nothing() -> None:
    model, new = _model_and_new_weights()
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    manager = _manager(model)
    try:
        name = next(iter(new))
        with pytest.raises(ValueError, match="no parameter or buffer named 'nope'"):
            manager.update_weights({**new, "nope": torch.zeros(1)})
        with pytest.raises(ValueError, match=f"{name} has shape"):
            manager.update_weights({name: torch.zeros(3, 3)})
        with pytest.raises(TypeError, match="must be a tensor"):
            manager.update_weights({name: [1.0]})
        with pytest.raises(ValueError, match="mode must be one of"):
            manager.update_weights(new, mode="later")
        prompt = random_prompts([8], seed=1)[0]
        output = collect_outputs(manager, [manager.add_request(prompt)])
    finally:
        manager.stop(block=True)
    for name, tensor in model.named_parameters():
        assert torch.equal(tensor, original[name]), name
    assert next(iter(output.values())).generated_tokens == reference_tokens(model, prompt, greedy_config(6))


def test_load_weights_from_a_saved_checkpoint(tmp_path) -> None:
    model, new = _model_and_new_weights(seed=5)
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for name, parameter in trained.named_parameters():
            parameter.copy_(new[name])
    trained.save_pretrained(tmp_path)
    manager = _manager(model)
    try:
        assert manager.load_weights(tmp_path) > 0
        prompt = random_prompts([12], seed=2)[0]
        output = collect_outputs(manager, [manager.add_request(prompt)])
    finally:
        manager.stop(block=True)
    assert next(iter(output.values())).generated_tokens == reference_tokens(trained, prompt, greedy_config(6))
    with pytest.raises(FileNotFoundError):
        manager.load_weights(tmp_path / "missing")


def test_reset_prefix_cache_stops_sharing() -> None:
    model = copy.deepcopy(tiny_model("qwen2"))
    prompt = random_prompts([20], seed=7)[0]
    manager = _manager(model)
    try:
        collect_outputs(manager, [manager.add_request(prompt)])
        assert manager.reset_prefix_cache() > 0
        hits = manager.stats()["prefix_hit_tokens"]
        collect_outputs(manager, [manager.add_request(prompt)])
        assert manager.stats()["prefix_hit_tokens"] == hits
    finally:
        manager.stop(block=True)


def test_sleep_frees_the_cache_and_wake_up_serves_exactly() -> None:
    """The KV cache's memory goes back to the system at `sleep()` (every page of it written first, so the process's
    RSS must drop by about the cache's size), `add_request` is refused while asleep, and after `wake_up()` greedy
    tokens equal `model.generate`."""
    psutil = pytest.importorskip("psutil")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=1024)).eval()
    model.generation_config.pad_token_id = 0
    prompts = random_prompts([400] * 32, seed=4)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(1), cbcore.ContinuousBatchingConfig(
        page_size=16, num_blocks=2048, allow_block_sharing=False))
    process = psutil.Process()
    manager.start()
    try:
        collect_outputs(manager, [manager.add_request(p) for p in prompts])
        # Every page made resident (the cache is lazily zeroed: untouched pages hold no memory); 256 MiB, so that what
        # else stopping allocates or frees (the model's own linear weights handed back: ~10 MB) is noise.
        with manager.pause():
            pages = manager.cache.key_caches + manager.cache.value_caches
            cache_bytes = sum(page.numel() * page.element_size() for page in pages)
            for page in pages:
                page.fill_(1.0)
            # Weak references only: a name left bound to one layer's pages (a loop variable) keeps its 32 MiB alive.
            alive = [weakref.ref(page) for page in pages]
            del pages, page
        awake = process.memory_info().rss
        manager.sleep()
        asleep = process.memory_info().rss
        assert manager.is_sleeping and manager.engine is None
        assert all(ref() is None for ref in alive), "a KV cache tensor outlived sleep()"
        with pytest.raises(RuntimeError, match="asleep"):
            manager.add_request(prompts[0])
        manager.wake_up()
        output = collect_outputs(manager, [manager.add_request(prompts[1][:20], max_new_tokens=6)])
    finally:
        manager.stop(block=True)
    assert cache_bytes == 256 * 2**20 and awake - asleep > 0.9 * cache_bytes, (cache_bytes, awake - asleep)
    assert next(iter(output.values())).generated_tokens == reference_tokens(model, prompts[1][:20], greedy_config(6))
