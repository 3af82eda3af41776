"""The edges of the manager, one defect per test: stop and pause never lie or hang, one request's problem stays its
own, every argument is checked where the caller can be told, and code written for transformers' manager finds what
it reads. Each waits with a timeout: nothing here can hang the suite."""

from __future__ import annotations

import math
import queue
import threading
import time

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, LogitsProcessor, LogitsProcessorList

import cbcore
from cbcore.engine.sizing import HostMemory, plan_num_host_blocks
from conftest import (
    VOCAB,
    assert_engine_clean,
    collect_outputs,
    greedy_config,
    random_prompts,
    reference_tokens,
    tiny_model,
)

WAIT_S = 30.0


def started(model, generation_config, **cb_kwargs) -> cbcore.ContinuousBatchingManager:
    manager = cbcore.ContinuousBatchingManager(model, generation_config, cbcore.ContinuousBatchingConfig(**cb_kwargs))
    manager.start()
    return manager


def drain(manager: cbcore.ContinuousBatchingManager) -> dict[str, cbcore.GenerationOutput]:
    """Every terminal output already delivered, by id (failing on a second one for any id)."""
    finals: dict[str, cbcore.GenerationOutput] = {}
    while (output := manager.get_result(timeout=0)) is not None:
        if output.is_finished():
            assert output.request_id not in finals, f"{output.request_id} ended twice"
            finals[output.request_id] = output
    return finals


def serve_one(manager: cbcore.ContinuousBatchingManager, input_ids, **kwargs) -> cbcore.GenerationOutput:
    """Serve one request on `manager` (started here unless it runs already), then stop it: its terminal output."""
    if not manager.is_running():
        manager.start()
    try:
        request_id = manager.add_request(input_ids, **kwargs)
        return collect_outputs(manager, [request_id])[request_id]
    finally:
        manager.stop()


def model_is_untouched(model: torch.nn.Module) -> bool:
    """The model's own attention, and no packed linear forward left on any module."""
    packed = any("forward" in vars(module) for module in model.modules() if isinstance(module, torch.nn.Linear))
    return model.config._attn_implementation == "sdpa" and not packed


class _Injected(BaseException):
    """Stands for a KeyboardInterrupt inside a step, without interrupting pytest itself."""


# ---- lifecycle -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["block_false", "expired_timeout", "context_manager_block_false"])
def test_stop_that_returns_early_leaves_in_flight_requests_exact_and_hands_the_model_back_at_the_end(how: str) -> None:
    model = cbcore.enable(tiny_model("llama_gqa"))
    prompts = random_prompts([7, 12, 3, 9], seed=101)
    config = greedy_config(24)
    if how == "context_manager_block_false":
        with model.continuous_batching_context_manager(
            generation_config=config, block=False, continuous_batching_config=cbcore.ContinuousBatchingConfig(page_size=4)
        ) as manager:
            ids = manager.add_requests(prompts)
    else:
        manager = started(model, config, page_size=4)
        ids = manager.add_requests(prompts)
        if how == "block_false":
            manager.stop(block=False)
        else:
            manager.stop(block=True, timeout=0.001)
    outputs = collect_outputs(manager, ids, timeout=WAIT_S) if manager.is_running() else drain(manager)
    manager.join(timeout=WAIT_S)
    assert not manager.is_running()
    assert model_is_untouched(model)
    for rid, prompt in zip(ids, prompts):
        assert outputs[rid].status == cbcore.RequestStatus.FINISHED
        assert outputs[rid].generated_tokens == reference_tokens(model, prompt, config)


@pytest.mark.parametrize("problem", ["cache_too_large", "no_host_block"])
def test_a_failed_start_leaves_the_model_untouched_and_can_be_retried(problem: str) -> None:
    model = tiny_model("qwen2")
    if problem == "cache_too_large":
        config = cbcore.ContinuousBatchingConfig(page_size=4096, num_blocks=2**24)
        match = "num_blocks=16777216 x page_size=4096 needs .* GiB of KV cache"
    else:
        config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=8, cpu_offload_space=1e-12)
        match = "cpu_offload_space=1e-12 GiB holds no block"
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(3), config)
    for _ in range(2):
        with pytest.raises(ValueError, match=match):
            manager.start()
        assert not manager.is_running()
        assert model_is_untouched(model)
        assert manager.cache is None


def test_an_invalid_generation_config_is_refused_before_the_model_is_touched() -> None:
    model = tiny_model("qwen2")
    bad = GenerationConfig(max_new_tokens=4, do_sample=False)
    bad.temperature = -1.0  # set after construction, as a user mutating a config would
    bad.do_sample = True
    with pytest.raises(ValueError, match="invalid GenerationConfig"):
        cbcore.ContinuousBatchingManager(model, bad, cbcore.ContinuousBatchingConfig(page_size=4))
    assert model_is_untouched(model)


def test_pause_raises_promptly_when_the_loop_dies_while_it_waits() -> None:
    model = tiny_model("llama_gqa")
    manager = started(model, greedy_config(50), page_size=4)
    in_step, release = threading.Event(), threading.Event()
    original = manager.runner.execute

    def stuck_then_dying(batch):
        in_step.set()
        release.wait(WAIT_S)
        raise _Injected("the step was interrupted")

    manager.runner.execute = stuck_then_dying
    manager.add_request([1, 2, 3])
    assert in_step.wait(WAIT_S)
    raised: list[BaseException] = []

    def pauser():
        try:
            with manager.pause():
                pass
        except RuntimeError as error:
            raised.append(error)

    thread = threading.Thread(target=pauser)
    thread.start()
    release.set()  # the loop dies while the pauser waits for it to park
    thread.join(WAIT_S)
    assert not thread.is_alive(), "pause() waited for a loop that is gone"
    assert raised and "stopped before it could pause" in str(raised[0])
    manager.runner.execute = original
    manager.join(timeout=WAIT_S)


def test_pause_racing_stop_always_returns_or_raises() -> None:
    model = tiny_model("qwen2")
    for round_ in range(20):
        manager = started(model, greedy_config(3), page_size=4)
        manager.add_request([1, 2, 3 + round_])
        outcome: list[str] = []

        def pauser():
            try:
                with manager.pause():
                    outcome.append("paused")
            except RuntimeError:
                outcome.append("raised")

        threads = [threading.Thread(target=pauser), threading.Thread(target=manager.stop)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
            assert not thread.is_alive(), f"round {round_}: a call hung"
        assert outcome in (["paused"], ["raised"])
        assert not manager.is_running()


def test_add_request_once_stopping_began_raises_until_started_again() -> None:
    model = tiny_model("llama_gqa")
    manager = started(model, greedy_config(40), page_size=4)
    first = manager.add_request([5, 6, 7])
    manager.stop(block=False)
    with pytest.raises(RuntimeError, match="stopping"):
        manager.add_request([1, 2])
    manager.join(timeout=WAIT_S)
    with pytest.raises(RuntimeError, match="stopping"):
        manager.add_request([1, 2])
    assert drain(manager)[first].status == cbcore.RequestStatus.FINISHED
    manager.start()
    try:
        again = manager.add_request([1, 2], max_new_tokens=3)
        assert collect_outputs(manager, [again])[again].status == cbcore.RequestStatus.FINISHED
    finally:
        manager.stop()
    assert_engine_clean(manager)


def test_add_request_racing_stop_is_either_served_or_refused() -> None:
    model = tiny_model("qwen2")
    manager = started(model, greedy_config(2), page_size=4)
    accepted: list[str] = []
    refused = 0

    def adder():
        nonlocal refused
        for index in range(200):
            try:
                accepted.append(manager.add_request([1, 2, 1 + index % 50]))
            except RuntimeError:
                refused += 1

    thread = threading.Thread(target=adder)
    thread.start()
    time.sleep(0.01)  # let some requests in before stopping (a race, not a synchronisation)
    manager.stop(block=True, timeout=WAIT_S)
    thread.join(WAIT_S)
    finals = drain(manager)
    assert set(finals) == set(accepted), "an accepted request was never served"
    assert len(accepted) + refused == 200
    assert_engine_clean(manager)


def test_a_cancel_right_after_add_is_never_lost() -> None:
    model = tiny_model("llama_gqa")
    manager = started(model, greedy_config(200), page_size=4, num_blocks=256)
    try:
        busy = manager.add_request(random_prompts([9], seed=7)[0], max_new_tokens=60)  # keeps the loop stepping
        ids = []
        for index in range(60):
            request_id = manager.add_request([1 + index % 90, 2, 3])
            manager.cancel_request(request_id)
            ids.append(request_id)
        outputs = collect_outputs(manager, ids + [busy], timeout=WAIT_S * 2)
    finally:
        manager.stop()
    assert {outputs[rid].status for rid in ids} == {cbcore.RequestStatus.CANCELLED}
    assert_engine_clean(manager)


def test_a_cancel_arriving_between_the_loops_intake_and_its_cancellation_pass_is_applied() -> None:
    """The race, made deterministic: the request lands in the queue just after the loop drained it, and its cancel
    just before the loop reads the cancels (transformers and cbcore before this fix dropped the cancel)."""
    model = tiny_model("llama_gqa")
    manager = started(model, greedy_config(40), page_size=4)
    intake = manager._take_new_requests
    raced: list[str] = []

    def intake_then_race() -> None:
        intake()
        if not raced:
            raced.append(manager.add_request([1, 2, 3]))
            manager.cancel_request(raced[0])

    manager._take_new_requests = intake_then_race
    try:
        deadline = time.monotonic() + WAIT_S
        while not raced:  # the idle loop runs its intake every 0.1 s
            assert time.monotonic() < deadline
            time.sleep(0.01)
        output = collect_outputs(manager, raced, timeout=WAIT_S)[raced[0]]
    finally:
        manager.stop()
    assert output.status == cbcore.RequestStatus.CANCELLED
    assert_engine_clean(manager)


def test_cancelling_a_child_before_its_fork_ends_it_and_it_is_never_forked() -> None:
    model = tiny_model("llama_gqa")
    config = GenerationConfig(max_new_tokens=5, do_sample=True, top_k=1, num_return_sequences=3, eos_token_id=None, pad_token_id=0)
    manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(page_size=4))
    parent = manager.add_request(random_prompts([10], seed=8)[0])
    manager.cancel_request(f"{parent}__child#1")  # the parent is queued: its children do not exist yet
    manager.start()
    try:
        family = [parent, f"{parent}__child#0", f"{parent}__child#1"]
        outputs = collect_outputs(manager, family)
    finally:
        manager.stop()
    assert outputs[f"{parent}__child#1"].status == cbcore.RequestStatus.CANCELLED
    assert outputs[parent].status == outputs[f"{parent}__child#0"].status == cbcore.RequestStatus.FINISHED
    assert drain(manager) == {}
    assert_engine_clean(manager)


def test_a_destroyed_manager_refuses_to_start_or_take_requests() -> None:
    manager = started(tiny_model("qwen2"), greedy_config(3), page_size=4)
    manager.destroy()
    for call in (manager.start, manager.warmup, lambda: manager.add_request([1, 2])):
        with pytest.raises(RuntimeError, match="destroyed"):
            call()
    assert model_is_untouched(tiny_model("qwen2"))


def test_a_base_exception_in_a_step_ends_every_request_and_the_death_is_visible() -> None:
    model = tiny_model("llama_gqa")
    manager = started(model, greedy_config(30), page_size=4)
    original = manager.runner.execute

    def interrupted(batch):
        raise _Injected("interrupted")

    manager.runner.execute = interrupted
    ids = manager.add_requests(random_prompts([4, 6, 8], seed=9))
    manager.join(timeout=WAIT_S)
    assert not manager.is_running()
    outputs = drain(manager)
    assert set(outputs) == set(ids)
    assert all(o.status == cbcore.RequestStatus.FAILED and "crashed" in o.error for o in outputs.values())
    assert isinstance(manager.background_thread_status.fatal_error, _Injected)
    with pytest.raises(RuntimeError, match="died"):
        manager.add_request([1, 2])
    assert model_is_untouched(model)
    # start() serves again, on a freshly built engine.
    manager.start()
    try:
        assert manager.runner.execute != interrupted
        prompt = random_prompts([5], seed=10)[0]
        rid = manager.add_request(prompt, max_new_tokens=4)
        assert collect_outputs(manager, [rid])[rid].generated_tokens == reference_tokens(model, prompt, greedy_config(4))
    finally:
        manager.stop()
    del original


# ---- one request, one failure ------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["bad_prompt", "cancelled_while_queued", "hard_stop"])
def test_children_end_with_a_parent_that_ends_before_its_fork(how: str) -> None:
    model = tiny_model("llama_gqa")
    config = GenerationConfig(max_new_tokens=5, do_sample=True, top_k=1, num_return_sequences=3, eos_token_id=None, pad_token_id=0)
    manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(page_size=4))
    parent = manager.add_request([] if how == "bad_prompt" else [1, 2, 3])
    if how == "cancelled_while_queued":
        manager.cancel_request(parent)
    manager.start()
    if how == "hard_stop":
        manager.stop(hard_stop=True)
    family = [f"{parent}__child#0", f"{parent}__child#1", parent]
    outputs = collect_outputs(manager, family) if manager.is_running() else drain(manager)
    manager.stop()
    assert set(outputs) == set(family)
    want = {"bad_prompt": cbcore.RequestStatus.FAILED, "cancelled_while_queued": cbcore.RequestStatus.CANCELLED}
    statuses = {output.status for output in outputs.values()}
    assert statuses == {want.get(how, cbcore.RequestStatus.FAILED)} or (
        how == "hard_stop" and cbcore.RequestStatus.FINISHED not in statuses
    )
    if how == "bad_prompt":
        assert all("empty prompt" in o.error and o.request_id in o.error for o in outputs.values())


def test_generate_batch_with_children_and_a_bad_prompt_returns() -> None:
    model = cbcore.enable(tiny_model("qwen2"))
    config = GenerationConfig(max_new_tokens=3, do_sample=True, top_k=1, num_return_sequences=2, eos_token_id=None, pad_token_id=0)
    outputs = model.generate_batch([[1, 2, 3], []], generation_config=config,
                                   continuous_batching_config=cbcore.ContinuousBatchingConfig(page_size=4))
    assert len(outputs) == 4
    assert outputs["req_1"].status == outputs["req_1__child#0"].status == cbcore.RequestStatus.FAILED
    assert outputs["req_0"].status == outputs["req_0__child#0"].status == cbcore.RequestStatus.FINISHED


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"max_new_tokens": "5"}, TypeError, "max_new_tokens must be an int"),
        ({"max_new_tokens": [5]}, TypeError, "max_new_tokens must be an int"),
        ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an int"),
        ({"max_new_tokens": math.nan}, TypeError, "max_new_tokens must be an int"),
        ({"max_new_tokens": -3}, ValueError, "max_new_tokens must be >= 1"),
        ({"request_id": ["a"]}, TypeError, "request_id must be a str"),
        ({"request_id": {"a": 1}}, TypeError, "request_id must be a str"),
        ({"input_ids": [1, None, 3]}, TypeError, r"input_ids\[1\] is None"),
        ({"input_ids": [1, 2.0]}, TypeError, r"input_ids\[1\] is 2.0"),
        ({"input_ids": [True, 2]}, TypeError, r"input_ids\[0\] is True"),
        ({"input_ids": torch.tensor([1.0, 2.0])}, TypeError, "dtype torch.float32"),
        ({"input_ids": torch.tensor([[1, 2]])}, TypeError, "1-D tensor .* add_requests"),
        ({"input_ids": "hello"}, TypeError, "tokenize the text first"),
        ({"input_ids": None}, TypeError, "got NoneType"),
        ({"eos_token_id": "5"}, TypeError, "eos_token_id must be"),
        ({"eos_token_id": 5.0}, TypeError, "eos_token_id must be"),
        ({"eos_token_id": [None]}, TypeError, r"eos_token_id\[0\] is None"),
    ],
)
def test_malformed_arguments_raise_in_add_request_and_queue_nothing(kwargs: dict, error: type, pattern: str) -> None:
    manager = cbcore.ContinuousBatchingManager(tiny_model("qwen2"), greedy_config(3), cbcore.ContinuousBatchingConfig(page_size=4))
    call = {"input_ids": [1, 2, 3]} | kwargs
    with pytest.raises(error, match=pattern):
        manager.add_request(**call)
    assert manager.input_queue.empty()
    assert manager.add_request([1, 2]) == "req_0"  # the refused call took no id


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"temperature": 0.0}, "temperature must be a finite number > 0"),
        ({"temperature": -1.0}, "temperature must be a finite number > 0"),
        ({"temperature": math.nan}, "temperature must be a finite number > 0"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_p": 1.5}, r"top_p must be in \[0, 1\]"),
    ],
)
def test_per_request_sampling_values_out_of_range_raise_in_add_request(kwargs: dict, pattern: str) -> None:
    config = GenerationConfig(max_new_tokens=3, do_sample=True, temperature=0.9, pad_token_id=0)
    manager = cbcore.ContinuousBatchingManager(
        tiny_model("qwen2"), config, cbcore.ContinuousBatchingConfig(page_size=4, per_request_processors=True)
    )
    with pytest.raises(ValueError, match=pattern):
        manager.add_request([1, 2, 3], **kwargs)


class _RaisesForMarkedPrompts(LogitsProcessor):
    """Raises for the rows whose history starts with the marker token, as a buggy user processor would."""

    MARKER = 7

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if int(input_ids[0, 0]) == self.MARKER:
            raise ValueError("this processor cannot handle the marked prompt")
        return scores


def test_a_logits_processor_raising_for_one_row_fails_that_request_alone() -> None:
    model = tiny_model("llama_gqa")
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(6), cbcore.ContinuousBatchingConfig(page_size=4))
    manager.warmup()
    sampler = manager.runner.sampler
    factory = sampler._processor_factory
    sampler._processor_factory = lambda *args: LogitsProcessorList([*factory(*args), _RaisesForMarkedPrompts()])
    sampler.has_processors = sampler.switch.do_processing = True
    prompts = random_prompts([5, 8, 11], seed=12)
    marked = [_RaisesForMarkedPrompts.MARKER] + prompts[1][1:]
    manager.start()
    try:
        ids = manager.add_requests([prompts[0], marked, prompts[2]])
        outputs = collect_outputs(manager, ids)
    finally:
        manager.stop()
    assert outputs[ids[1]].status == cbcore.RequestStatus.FAILED
    assert ids[1] in outputs[ids[1]].error and "cannot handle the marked prompt" in outputs[ids[1]].error
    for index in (0, 2):
        assert outputs[ids[index]].generated_tokens == reference_tokens(model, prompts[index], greedy_config(6))
    assert_engine_clean(manager)


def test_a_forward_failing_because_of_one_request_fails_it_alone() -> None:
    model = tiny_model("qwen2")
    manager = started(model, greedy_config(5), page_size=4)
    original = manager.runner.execute

    def poisoned(batch):
        if any(item.state.initial_tokens[0] == 13 for item in batch.requests):
            raise RuntimeError("forward cannot take token 13 first")
        return original(batch)

    manager.runner.execute = poisoned
    prompts = random_prompts([6, 9, 4, 7], seed=13)
    prompts[2] = [13] + prompts[2][1:]
    try:
        ids = manager.add_requests(prompts)
        outputs = collect_outputs(manager, ids)
    finally:
        manager.stop()
    assert outputs[ids[2]].status == cbcore.RequestStatus.FAILED and "token 13" in outputs[ids[2]].error
    for index in (0, 1, 3):
        assert outputs[ids[index]].generated_tokens == reference_tokens(model, prompts[index], greedy_config(5))
    assert_engine_clean(manager)


def test_prompts_past_gpt2_position_table_fail_alone() -> None:
    torch.manual_seed(5)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2)).eval()
    model.generation_config.pad_token_id = 0
    prompts = random_prompts([40, 30, 10], seed=14)
    manager = started(model, greedy_config(None), page_size=4, num_blocks=64)
    try:
        ids = manager.add_requests(prompts, max_new_tokens=8)
        unbounded = manager.add_request(prompts[2])  # the config's max_new_tokens: None
        outputs = collect_outputs(manager, ids + [unbounded])
    finally:
        manager.stop()
    assert "has 32 positions" in outputs[ids[0]].error  # the prompt alone is too long
    assert "has 32 positions" in outputs[ids[1]].error  # the prompt fits, but not with 8 new tokens
    assert outputs[ids[2]].generated_tokens == reference_tokens(model, prompts[2], greedy_config(8))
    assert outputs[unbounded].status == cbcore.RequestStatus.FINISHED  # ends at the end of the table
    assert len(prompts[2]) + len(outputs[unbounded].generated_tokens) - 1 == 32
    assert_engine_clean(manager)


def test_token_ids_as_tensors_arrays_and_numpy_integers_are_accepted() -> None:
    model = tiny_model("llama_gqa")
    prompts = random_prompts([5, 7], seed=15)
    manager = started(model, greedy_config(4), page_size=4)
    try:
        ids = [
            manager.add_request(torch.tensor(prompts[0])),
            manager.add_request(np.array(prompts[1], dtype=np.int32), max_new_tokens=np.int64(4)),
            manager.add_request([np.int64(t) for t in prompts[0]]),
            *manager.add_requests(torch.tensor([prompts[0][:5], prompts[1][:5]])),
        ]
        outputs = collect_outputs(manager, ids)
    finally:
        manager.stop()
    expected = [prompts[0], prompts[1], prompts[0], prompts[0][:5], prompts[1][:5]]
    for rid, prompt in zip(ids, expected):
        assert outputs[rid].prompt_ids == prompt and all(type(t) is int for t in outputs[rid].prompt_ids)
        assert outputs[rid].generated_tokens == reference_tokens(model, prompt, greedy_config(4))


def test_eos_token_id_given_as_a_tensor_is_honoured() -> None:
    model = tiny_model("llama_gqa")
    prompt = random_prompts([6], seed=16)[0]
    free_run = reference_tokens(model, prompt, greedy_config(10))
    eos = free_run[3]
    manager = started(model, greedy_config(10), page_size=4)
    output = serve_one(manager, prompt, eos_token_id=torch.tensor(eos))
    assert output.generated_tokens == free_run[: free_run.index(eos) + 1]


@pytest.mark.parametrize(
    ("inputs", "pattern"),
    [
        ([[1, 2], None], r"inputs\[1\] must be a list"),
        ([[1, 2], "abc"], r"inputs\[1\] is a str"),
        ([1, 2, 3], "flat list of ints"),
        ("abc", "inputs must be a list of prompts"),
        (torch.tensor([1, 2, 3]), "2-D"),
    ],
)
def test_add_requests_and_generate_batch_name_the_bad_prompt(inputs, pattern: str) -> None:
    model = cbcore.enable(tiny_model("qwen2"))
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(3), cbcore.ContinuousBatchingConfig(page_size=4))
    with pytest.raises(TypeError, match=pattern):
        manager.add_requests(inputs)
    assert manager.input_queue.empty()
    with pytest.raises(TypeError, match=pattern):
        model.generate_batch(inputs, generation_config=greedy_config(3))
    assert model_is_untouched(model)


def test_automatic_ids_skip_ids_the_caller_chose() -> None:
    manager = cbcore.ContinuousBatchingManager(tiny_model("qwen2"), greedy_config(3), cbcore.ContinuousBatchingConfig(page_size=4))
    assert manager.add_request([1], request_id="req_1") == "req_1"
    assert manager.add_request([1], request_id="req_3") == "req_3"
    assert [manager.add_request([2]), manager.add_request([2])] == ["req_0", "req_2"]
    assert manager.add_requests([[3], [3]]) == ["req_4", "req_5"]


def test_a_duplicate_live_id_raises_and_a_finished_id_can_be_reused() -> None:
    manager = started(tiny_model("qwen2"), greedy_config(3), page_size=4)
    try:
        manager.add_request([1, 2], request_id="mine")
        with pytest.raises(ValueError, match="request mine: duplicate request id"):
            manager.add_request([1, 2], request_id="mine")
        collect_outputs(manager, ["mine"])
        manager.add_request([3, 4], request_id="mine")  # ended: the id is free again
        assert collect_outputs(manager, ["mine"])["mine"].prompt_ids == [3, 4]
    finally:
        manager.stop()


# ---- configs -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"page_size": "8"}, TypeError, "page_size must be an int"),
        ({"page_size": 8.0}, TypeError, "page_size must be an int"),
        ({"page_size": None}, TypeError, "page_size must be an int, got None"),
        ({"num_blocks": 2.5}, TypeError, "num_blocks must be an int or None"),
        ({"num_blocks": "10"}, TypeError, "num_blocks must be an int or None"),
        ({"max_batch_tokens": 2.5}, TypeError, "max_batch_tokens must be an int or None"),
        ({"max_requests_per_batch": True}, TypeError, "max_requests_per_batch must be an int or None"),
        ({"max_memory_percent": "half"}, TypeError, "max_memory_percent must be a number or None"),
        ({"safety_margin": math.nan}, TypeError, "safety_margin must be a number or None"),
        ({"seed": "x"}, TypeError, "seed must be an int or None"),
        ({"seed": -1}, ValueError, r"seed must be in \[0, 2\*\*64\)"),
        ({"scheduler_type": None}, TypeError, "scheduler_type must be a str"),
        ({"allow_block_sharing": "yes"}, TypeError, "allow_block_sharing must be True or False"),
        ({"return_logprobs": 1}, TypeError, "return_logprobs must be True or False"),
        ({"cpu_offload_space": "1"}, TypeError, "cpu_offload_space must be a number or None"),
        ({"max_queue_size": None}, TypeError, "max_queue_size must be an int"),
        ({"cpu_group_timeout": 0}, ValueError, "cpu_group_timeout must be > 0"),
        ({"use_cuda_graph": "yes"}, TypeError, "use_cuda_graph must be None, a bool or a pair of bools"),
        ({"q_padding_interval_size": -1}, ValueError, "q_padding_interval_size must be >= 0"),
    ],
)
def test_every_config_field_is_type_and_range_checked(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        cbcore.ContinuousBatchingConfig(**kwargs)


def test_a_host_pool_is_capped_by_the_memory_available_not_only_the_total(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = HostMemory(available=2**30, bound="the RAM available", total=100 * 2**30)
    monkeypatch.setattr("cbcore.engine.sizing.host_memory", lambda: memory)
    block = 2**20
    assert plan_num_host_blocks(None, 0.8, block).num_blocks == int(0.8 * 2**30) // block
    assert plan_num_host_blocks(10**6, 0.8, block).num_blocks == int(0.8 * 2**30) // block
    assert plan_num_host_blocks(0.5, 0.8, block).num_blocks == 512


# ---- the drop-in: what transformers' code relies on --------------------------------------------------------------


def test_eos_is_resolved_as_model_generate_resolves_it() -> None:
    """The model config's eos_token_id is not consulted: `model.generation_config.eos_token_id = None` means no EOS."""
    model = tiny_model("qwen2")
    prompt = random_prompts([6], seed=17)[0]
    free_run = reference_tokens(model, prompt, greedy_config(8))
    saved = (model.config.eos_token_id, model.generation_config.eos_token_id)
    try:
        model.config.eos_token_id = free_run[2]
        model.generation_config.eos_token_id = None
        config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0)
        want = model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
        manager = started(model, config, page_size=4)
        try:
            rid = manager.add_request(prompt)
            got = collect_outputs(manager, [rid])[rid].generated_tokens
        finally:
            manager.stop()
    finally:
        model.config.eos_token_id, model.generation_config.eos_token_id = saved
    assert got == want == free_run


def test_forced_eos_lands_where_model_generate_puts_it() -> None:
    model = tiny_model("llama_gqa")
    prompts = random_prompts([5, 11], seed=18)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, forced_eos_token_id=3, eos_token_id=3, pad_token_id=0)
    manager = started(model, config, page_size=4)
    try:
        ids = manager.add_requests(prompts) + [manager.add_request(prompts[0], max_new_tokens=4)]
        outputs = collect_outputs(manager, ids)
    finally:
        manager.stop()
    for rid, prompt, new in zip(ids, prompts + [prompts[0]], (6, 6, 4)):
        want_config = GenerationConfig(**(config.to_dict() | {"max_new_tokens": new}))
        assert outputs[rid].generated_tokens == reference_tokens(model, prompt, want_config)
        assert outputs[rid].generated_tokens[-1] == 3


@pytest.mark.parametrize(
    "settings", [{"num_beams": 2}, {"penalty_alpha": 0.6, "top_k": 4}, {"dola_layers": "low"}], ids=str
)
def test_generation_modes_cbcore_does_not_implement_are_refused(settings: dict) -> None:
    config = GenerationConfig(max_new_tokens=4, pad_token_id=0, **settings)
    with pytest.raises(NotImplementedError, match="generation mode"):
        cbcore.ContinuousBatchingManager(tiny_model("qwen2"), config, cbcore.ContinuousBatchingConfig(page_size=4))


def test_the_generation_config_is_read_when_transformers_reads_it() -> None:
    """Processors are built with the manager (a repetition penalty set afterwards does nothing), `do_sample` is read
    when the engine is built, and `max_new_tokens` by each add_request: as in transformers."""
    model = tiny_model("llama_gqa")
    prompt = random_prompts([7], seed=19)[0]
    sampled = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=10, eos_token_id=None, pad_token_id=0)
    manager = cbcore.ContinuousBatchingManager(model, sampled, cbcore.ContinuousBatchingConfig(page_size=4))
    manager.generation_config.repetition_penalty = 50.0
    manager.generation_config.do_sample = False
    manager.generation_config.max_new_tokens = 3
    output = serve_one(manager, prompt)
    assert output.generated_tokens == reference_tokens(model, prompt, greedy_config(3))


def test_a_request_longer_than_the_cache_with_a_prompt_that_fits_ends_finished_when_it_fills_it() -> None:
    model = tiny_model("llama_gqa")
    prompt = random_prompts([6], seed=20)[0]
    manager = started(model, greedy_config(100), page_size=4, num_blocks=4)  # 16 tokens
    output = serve_one(manager, prompt)
    assert output.status == cbcore.RequestStatus.FINISHED
    assert output.generated_tokens == reference_tokens(model, prompt, greedy_config(11))
    assert_engine_clean(manager)


def test_background_thread_status_says_whether_the_loop_is_healthy() -> None:
    manager = started(tiny_model("qwen2"), greedy_config(3), page_size=4)
    try:
        assert manager.background_thread_status.fatal_error is None
    finally:
        manager.stop()


def test_logit_processor_clear_turns_every_processor_off() -> None:
    """`manager.logit_processor` is what transformers' code reads; after `clear()` the sampler sees raw logits, so a
    repetition-penalised config generates what plain greedy does."""
    model = tiny_model("llama_gqa")
    prompt = random_prompts([6], seed=22)[0]
    penalised = GenerationConfig(max_new_tokens=6, do_sample=False, repetition_penalty=5.0, eos_token_id=None,
                                 pad_token_id=0)
    manager = cbcore.ContinuousBatchingManager(model, penalised, cbcore.ContinuousBatchingConfig(page_size=4))
    assert manager.logit_processor.do_processing and len(manager.logit_processor.logits_processor) == 1
    manager.logit_processor.clear()
    assert not manager.logit_processor.do_processing
    output = serve_one(manager, prompt)
    assert output.generated_tokens == reference_tokens(model, prompt, greedy_config(6))


def test_per_request_sampling_values_apply_when_the_config_builds_no_processor() -> None:
    """A sampling config at its defaults builds no logits processor; a request's own top_k=1 must still apply (it is
    greedy then), not be dropped because the manager-wide list is empty."""
    model = tiny_model("llama_gqa")
    prompt = random_prompts([7], seed=23)[0]
    config = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                              eos_token_id=None, pad_token_id=0)
    manager = started(model, config, page_size=4, per_request_processors=True, seed=4)
    try:
        assert not manager.logit_processor.do_processing
        rid = manager.add_request(prompt, top_k=1)
        output = collect_outputs(manager, [rid])[rid]
    finally:
        manager.stop()
    assert output.generated_tokens == reference_tokens(model, prompt, greedy_config(6))


def test_prompts_of_plain_ints_are_copied_and_other_integers_converted() -> None:
    """The fast path (every element a plain int) returns a copy, so the caller's list changing later changes no
    request; other integer types (numpy's, 0-d tensors, int subclasses) take the element-wise path and come out as
    plain ints."""
    from cbcore.request_inputs import token_ids

    ids = [1, 2, 3]
    out = token_ids(ids, "x")
    assert out == ids and out is not ids
    assert token_ids((4, 5), "x") == [4, 5] and token_ids([], "x") == []
    mixed = token_ids([6, torch.tensor(7), np.int64(8)], "x")
    assert mixed == [6, 7, 8] and all(type(t) is int for t in mixed)
