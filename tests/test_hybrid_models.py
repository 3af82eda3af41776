"""Hybrid and recurrent models on state slots (cbcore/state_slots.py, cbcore/state_layers.py): tiny seeded Qwen3.5,
Qwen3-Next, Mamba-2, Jamba and Falcon-H1 models (the architecture sweep's, with one stateful and one attention
layer; Mamba-2 has no attention) served exactly as `model.generate` serves them, one prompt at a time, through
chunked prefill, preemption by swap and by recompute, `num_return_sequences` forks, cancellation mid-prefill and a
shared prefix; and every slot back in its pool afterwards (`assert_engine_clean`, the engine's `check()`).

Jamba's Mamba-1 mixer ignores its state in its multi-token form, so its continuation chunks run one token at a time
(cbcore/state_layers.py says why); it is here for that path."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import architecture_sweep as sweep
import cbcore
from cbcore import RequestStatus
from cbcore.engine import EngineCore
from cbcore.requests import RequestState, child_request_id
from conftest import collect_outputs, assert_engine_clean, run_engine

HYBRIDS = ("qwen3_5", "qwen3_next", "mamba2", "jamba", "falcon_h1")
# A prompt of 30 tokens over a budget of 8 per step: prefilled in 4 chunks, mixed with the others' decodes.
PROMPT_LENGTHS = (1, 9, 30)
NEW_TOKENS = 8

_MODELS: dict[str, torch.nn.Module] = {}


def model_of(model_type: str) -> torch.nn.Module:
    if model_type not in _MODELS:
        _MODELS[model_type] = sweep.build_model(model_type)
    return _MODELS[model_type]


def prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, sweep.VOCAB - 8, (n,), generator=generator).tolist() for n in lengths]


def greedy(max_new_tokens: int = NEW_TOKENS) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                            bos_token_id=None)


def generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy(max_new_tokens))
    return out[0, len(prompt):].tolist()


def assert_same_as_generate(model, prompt_list, outputs, max_new_tokens: int = NEW_TOKENS) -> None:
    for prompt, output in zip(prompt_list, outputs):
        assert output.status == RequestStatus.FINISHED, output.error
        assert output.generated_tokens == generate(model, prompt, max_new_tokens), f"{len(prompt)}-token prompt"


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_chunked_prefill_and_mixed_steps_equal_generate(model_type: str) -> None:
    model = model_of(model_type)
    prompt_list = prompts()
    config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=8)
    outputs, manager = run_engine(model, prompt_list, greedy(), config)
    assert_same_as_generate(model, prompt_list, outputs.values())
    stats = manager.stats()
    assert stats["state_slots"] == stats["state_slots_free"] > 0
    assert stats["steps"] >= 30 // 8 + NEW_TOKENS  # the long prompt took at least 4 steps


@pytest.mark.parametrize("model_type", ("qwen3_5", "jamba", "mamba2"))
@pytest.mark.parametrize("swap", (True, False), ids=("swap", "recompute"))
def test_preemption_mid_generation_keeps_the_state(model_type: str, swap: bool) -> None:
    model = model_of(model_type)
    prompt_list = prompts((5, 12, 9, 17, 3, 14), seed=1)
    # 10 blocks of 4 tokens for 6 requests of up to 17 + 12 tokens: requests are preempted while they decode.
    config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=10, max_batch_tokens=32,
                                             cpu_offload_space=0.01 if swap else 0.0)
    outputs, manager = run_engine(model, prompt_list, greedy(12), config)
    assert_same_as_generate(model, prompt_list, outputs.values(), 12)
    stats = manager.stats()
    assert stats["preemptions"] > 0
    if swap:
        assert stats["swap_preemptions"] > 0  # the swapped request kept its slot: its state resumed where it was
    else:
        assert stats["recompute_preemptions"] > 0 and stats["recomputed_tokens"] > 0


def _teacher_forced_logprobs(model, prompt: list[int], generated: list[int]) -> list[float]:
    """The model's own log-probability of each generated token given everything before it (one forward, no cache)."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(generated)]


def _serve_with_children(model, prompt_list, config: GenerationConfig, cb_config, num_children: int):
    """Every output, children's included (`<parent>__child#<i>`), by id."""
    manager = cbcore.ContinuousBatchingManager(model, config, cb_config)
    manager.start()
    try:
        parents = manager.add_requests(prompt_list)
        ids = [i for p in parents for i in [p] + [child_request_id(p, c) for c in range(num_children)]]
        finals = collect_outputs(manager, ids)
    finally:
        manager.stop(block=True, timeout=60)
    assert_engine_clean(manager)
    return parents, finals


@pytest.mark.parametrize("model_type", ("qwen3_5", "jamba", "mamba2"))
def test_num_return_sequences_forks_start_from_the_parents_state(model_type: str) -> None:
    """Three sampled sequences per prompt: each one's log-probabilities must be what the model gives that sequence
    (a child started from a wrong state would report other numbers)."""
    model = model_of(model_type)
    prompt_list = prompts((6, 13), seed=2)
    config = GenerationConfig(max_new_tokens=6, do_sample=True, num_return_sequences=3, eos_token_id=None,
                              pad_token_id=0, bos_token_id=None, top_k=0)
    cb_config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=8, return_logprobs=True,
                                                seed=11)
    parents, finals = _serve_with_children(model, prompt_list, config, cb_config, 2)
    for prompt, parent in zip(prompt_list, parents):
        sequences = [finals[parent]] + [finals[child_request_id(parent, c)] for c in range(2)]
        assert len({tuple(s.generated_tokens) for s in sequences}) > 1, "the children did not sample on their own"
        for output in sequences:
            assert output.status == RequestStatus.FINISHED, output.error
            want = _teacher_forced_logprobs(model, prompt, output.generated_tokens)
            assert output.logprobs == pytest.approx(want, abs=1e-4), output.request_id


def test_children_are_separate_outputs_and_equal_greedy_generate() -> None:
    """Greedy children all continue from the parent's state: each equals `model.generate`."""
    model = model_of("qwen3_5")
    prompt = prompts((11,), seed=3)[0]
    config = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=1, num_return_sequences=3, eos_token_id=None,
                              pad_token_id=0, bos_token_id=None)
    (parent,), finals = _serve_with_children(model, [prompt], config,
                                             cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=64), 2)
    want = generate(model, prompt, 6)
    assert len(finals) == 3
    for output in finals.values():
        assert output.generated_tokens == want, output.request_id


def _engine(model, **cb_kwargs) -> EngineCore:
    manager = cbcore.ContinuousBatchingManager(model, greedy(), cbcore.ContinuousBatchingConfig(**cb_kwargs))
    manager.warmup()
    manager.engine.binding.attach()
    return manager.engine


def test_cancel_mid_prefill_frees_the_slot_and_leaves_the_others_exact() -> None:
    model = model_of("qwen3_next")
    engine = _engine(model, page_size=4, num_blocks=64, max_batch_tokens=8)
    try:
        long_prompt, short_prompt = prompts((40, 7), seed=4)
        engine.add_request(RequestState(request_id="long", initial_tokens=long_prompt, max_new_tokens=NEW_TOKENS,
                                        eos_token_id=-1))
        engine.add_request(RequestState(request_id="short", initial_tokens=short_prompt, max_new_tokens=NEW_TOKENS,
                                        eos_token_id=-1))
        engine.step()
        engine.step()
        (long_state,) = [s for s in engine.live_requests() if s.request_id == "long"]
        assert 0 < long_state.num_computed_tokens < len(long_prompt) and long_state.state_slot is not None
        cancelled = engine.abort("long")
        assert [o.status for o in cancelled] == [RequestStatus.CANCELLED]
        finals = {}
        while engine.has_work():
            finals.update({o.request_id: o for o in engine.step() if o.is_finished()})
        engine.check()
        assert engine.cache.state_slots.num_free == engine.cache.state_slots.num_slots
        assert finals["short"].generated_tokens == generate(model, short_prompt)
    finally:
        engine.binding.detach()


@pytest.mark.parametrize("share", (True, False), ids=("sharing-on", "sharing-off"))
def test_a_prefix_shared_by_eight_requests(share: bool) -> None:
    """Tokens equal `model.generate` with block sharing asked for or not. A model with stateful layers computes every
    prompt whole for now (its state at a shared prefix's end is not kept), so nothing is taken from the prefix cache
    either way."""
    model = model_of("qwen3_5")
    prefix = prompts((16,), seed=5)[0]
    prompt_list = [prefix + tail for tail in prompts((3,) * 8, seed=6)]
    config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=96, max_batch_tokens=32,
                                             allow_block_sharing=share)
    outputs, manager = run_engine(model, prompt_list, greedy(6), config)
    assert_same_as_generate(model, prompt_list, outputs.values(), 6)
    assert manager.stats()["prefix_hit_tokens"] == 0


def test_slots_bound_the_running_requests() -> None:
    """With 2 slots (max_requests_per_batch=2), 5 requests run two at a time and all end exactly."""
    model = model_of("mamba2")
    prompt_list = prompts((4, 9, 2, 12, 6), seed=7)
    config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=64, max_requests_per_batch=2)
    outputs, manager = run_engine(model, prompt_list, greedy(), config)
    assert_same_as_generate(model, prompt_list, outputs.values())
    assert manager.stats()["state_slots"] == 2


def test_the_compiled_step_is_refused_for_a_stateful_model() -> None:
    from transformers.generation.configuration_utils import CompileConfig

    model = model_of("qwen3_next")
    config = greedy()
    cb_config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=16, varlen_compile_config=CompileConfig())
    manager = cbcore.ContinuousBatchingManager(model, config, cb_config)
    with pytest.raises(NotImplementedError, match="Qwen3NextForCausalLM.*per-request state.*compiled step"):
        manager.warmup()


class _RaisesForMarkedPrompts:
    """A logits processor that fails the request whose prompt starts with `MARKER` once it has generated 3 tokens:
    sampling raises in a decode step, after the forward has advanced every request's state from its previous one."""

    MARKER = 7
    AFTER = 8 + 3  # the marked prompt's length + tokens generated before it fails

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if int(input_ids[0, 0]) == self.MARKER and input_ids.shape[-1] >= self.AFTER:
            raise ValueError("this processor cannot handle the marked prompt")
        return scores


def test_a_failing_request_fails_alone_and_the_others_states_stay_exact() -> None:
    """Finding the culprit reruns parts of the step; a recurrent state advanced by a failed attempt cannot be run
    again, so the others are recomputed from their tokens: their output is still exactly `model.generate`'s."""
    from transformers import LogitsProcessorList

    model = model_of("qwen3_5")
    manager = cbcore.ContinuousBatchingManager(model, greedy(), cbcore.ContinuousBatchingConfig(page_size=4,
                                                                                                 num_blocks=64))
    manager.warmup()
    sampler = manager.runner.sampler
    factory = sampler._processor_factory
    sampler._processor_factory = lambda *args: LogitsProcessorList([*factory(*args), _RaisesForMarkedPrompts()])
    sampler.has_processors = sampler.switch.do_processing = True
    prompt_list = prompts((5, 8, 11, 6), seed=8)
    prompt_list[1] = [_RaisesForMarkedPrompts.MARKER] + prompt_list[1][1:]
    manager.start()
    try:
        ids = manager.add_requests(prompt_list)
        outputs = collect_outputs(manager, ids)
    finally:
        manager.stop(block=True, timeout=60)
    assert outputs[ids[1]].status == RequestStatus.FAILED and "marked prompt" in outputs[ids[1]].error
    for index in (0, 2, 3):
        assert outputs[ids[index]].generated_tokens == generate(model, prompt_list[index]), index
    assert_engine_clean(manager)
