"""transformers' own serving layer (`transformers serve`'s back end) drives a cbcore manager unchanged.

Each transformers version has its own back end: 5.24's `CBGenerateManager` (the server awaits each request on an
asyncio loop), 5.25's `CBGenerateRunner` (a runner in the model's process: requests in through `generate`, tokens
and ends out through a `send_results` callback, a statistics line that reads the manager's batch processor). The
test for the version installed runs; the other's class does not exist there, and its skip says so.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import transformers
from transformers import GenerationConfig

import cbcore
from conftest import assert_engine_clean, random_prompts, reference_tokens, tiny_model

WAIT_S = 30.0


def greedy(max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


def serving_class(name: str):
    """`transformers.cli.serving.utils.<name>`, or a skip naming the transformers version that lacks it."""
    from transformers.cli.serving import utils

    if not hasattr(utils, name):
        pytest.skip(f"transformers {transformers.__version__}'s serving layer has no {name}")
    return getattr(utils, name)


class Detokenizer:
    """The processor the serving layer hands `decode` to: token ids as text, one word each."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def test_cb_generate_manager_of_transformers_5_24_drives_a_cbcore_manager() -> None:
    """5.24's `CBGenerateManager`: `init_cb` builds the manager through the model's `init_continuous_batching`,
    `generate_non_streaming` adds a request and awaits its result."""
    manager_class = serving_class("CBGenerateManager")
    model = cbcore.enable(tiny_model("llama_gqa"))
    serving = manager_class(cbcore.ContinuousBatchingConfig(page_size=4))
    config = greedy(5)
    serving.init_cb(model, config)
    assert isinstance(serving._cb, cbcore.ContinuousBatchingManager)
    prompts = random_prompts([6, 9], seed=21)

    async def serve_two():
        return await asyncio.gather(*(
            asyncio.wait_for(serving.generate_non_streaming(model, Detokenizer(), {"input_ids": prompt}, config,
                                                            f"chat-{i}"), WAIT_S)
            for i, prompt in enumerate(prompts)
        ))

    try:
        assert serving.is_alive()
        results = asyncio.run(serve_two())
    finally:
        serving.stop()
    for (text, input_len, generated), prompt in zip(results, prompts):
        assert input_len == len(prompt)
        assert list(generated) == reference_tokens(model, prompt, config)
        assert text == " ".join(str(i) for i in generated)
    assert not serving._cb.is_running()


class Results:
    """What a 5.25 runner sends (`send_results(ids, tokens, finished)`), gathered per request."""

    def __init__(self) -> None:
        self.streamed: dict[int, list[int]] = {}
        self.finished: dict[int, object] = {}
        self.changed = threading.Condition()

    def __call__(self, ids, tokens, finished) -> None:
        with self.changed:
            for request_id, token in zip(ids, tokens):
                self.streamed.setdefault(request_id, []).append(token)
            for request_id, result in finished:
                assert request_id not in self.finished, f"request {request_id} ended twice"
                self.finished[request_id] = result
            self.changed.notify_all()

    def wait_for(self, request_ids) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: set(request_ids) <= set(self.finished), timeout=WAIT_S), \
                f"requests {sorted(set(request_ids) - set(self.finished))} never ended"


def generation_kwargs(max_new_tokens: int, **overrides) -> dict:
    """A request's `generation_kwargs` as 5.25's handlers build them (`BaseHandler._build_generation_kwargs`)."""
    kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=None, do_sample=False, temperature=None, top_k=None,
                  top_p=None)
    kwargs.update(overrides)
    return kwargs


def test_cb_generate_runner_of_transformers_5_25_drives_a_cbcore_manager() -> None:
    """5.25's `CBGenerateRunner`: it builds the manager through the model's `init_continuous_batching` (with
    per-request processors on), warms it up, starts it and reads its outputs on a thread of its own. A streaming and a
    non-streaming request give `model.generate`'s tokens, a cancelled one leaves the batch, a
    greedy request's {"top_k": 1} is dropped because the manager says it supports no per-request key
    (`logit_processor.supported_keys`), and the statistics line's reads of `batch_processor` work while requests
    run."""
    runner_class = serving_class("CBGenerateRunner")
    model = cbcore.enable(tiny_model("llama_gqa"))
    model.generation_config = greedy(6)
    results = Results()
    runner = runner_class(model, Detokenizer(), results, cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=64))
    manager = runner.manager
    try:
        assert isinstance(manager, cbcore.ContinuousBatchingManager)
        assert manager.continuous_batching_config.per_request_processors
        # A greedy config builds no sampling processor: no per-request key is supported, as in transformers, so the
        # runner's {"top_k": 1} for a greedy request is dropped rather than refused by add_request.
        assert manager.logit_processor.supported_keys == {}
        prompts = random_prompts([5, 9, 7], seed=22)
        runner.generate(0, {"input_ids": prompts[0]}, generation_kwargs(6), stream=True)
        runner.generate(1, {"input_ids": prompts[1]}, generation_kwargs(4), stream=False)
        running, waiting, details = runner.state()
        assert running >= 0 and waiting >= 0 and "KV cache" in details
        results.wait_for([0, 1])
        runner.generate(2, {"input_ids": prompts[2]}, generation_kwargs(50), stream=True)
        runner.cancel(2)
        # The runner sends nothing for a request it cancelled (the API server ended it already): the manager's
        # batch empties, as the statistics line sees it.
        deadline = time.monotonic() + WAIT_S
        while runner.state()[:2] != (0, 0):
            assert time.monotonic() < deadline, f"the cancelled request still runs: {runner.state()}"
            time.sleep(0.01)
    finally:
        manager.stop(block=True)
        # The runner's output thread asks the manager for results until it reports a fatal error: a stopped manager
        # answers None at once (as transformers' does), so the thread would spin for the rest of the process and slow
        # every later test. Its designed exit is the fatal-error path; take it.
        manager.background_thread_status.fatal_error = RuntimeError("the test is over")
    assert results.finished[0] is None  # streamed: its tokens went out as they came
    assert results.streamed[0] == reference_tokens(model, prompts[0], greedy(6))
    assert results.finished[1] == reference_tokens(model, prompts[1], greedy(4))
    assert 1 not in results.streamed
    assert len(results.streamed.get(2, [])) < 50 and 2 not in results.finished
    assert_engine_clean(manager)


def test_batch_processor_is_none_until_the_engine_is_built_and_reads_the_engine_after() -> None:
    """`manager.batch_processor`, as transformers' attribute: None before the processor exists; then the scheduler's
    active and waiting requests and the cache's free capacity (all of it free when nothing runs)."""
    manager = cbcore.ContinuousBatchingManager(tiny_model("llama_gqa"), greedy(3),
                                               cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=32))
    assert manager.batch_processor is None
    manager.start()
    try:
        output = manager.get_result(manager.add_request([1, 2, 3]), timeout=WAIT_S)
        assert output.is_finished()
        view = manager.batch_processor
        assert len(view.scheduler.active_requests) == 0 and len(view.scheduler.waiting_requests) == 0
        assert view.cache.compute_free_capacity() == 1.0
        assert view.cache.compute_free_capacity(relative=False) == manager.cache.nbytes
    finally:
        manager.stop(block=True)


def test_supported_keys_list_the_per_request_sampling_values_a_sampling_manager_takes() -> None:
    """With per-request processors and a sampling config, `logit_processor.supported_keys` names temperature, top_k
    and top_p with their types (transformers 5.25's serving layer casts each request's values to them)."""
    config = GenerationConfig(max_new_tokens=3, do_sample=True, top_k=5, eos_token_id=None, pad_token_id=0)
    sampling = cbcore.ContinuousBatchingManager(tiny_model("llama_gqa"), config,
                                                cbcore.ContinuousBatchingConfig(per_request_processors=True))
    assert sampling.logit_processor.supported_keys == {"temperature": float, "top_k": int, "top_p": float}
    without = cbcore.ContinuousBatchingManager(tiny_model("llama_gqa"), config, cbcore.ContinuousBatchingConfig())
    assert without.logit_processor.supported_keys == {}
