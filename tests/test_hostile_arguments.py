"""Hostile arguments never reach the generation loop. Every public method of the manager and of the mixin is called
with values of the wrong type in each of its arguments (None, an int, a float, a tuple, bytes, a nested list, tensors
of the wrong dtype or shape): each call raises TypeError / ValueError naming the method and the argument, and the same
manager then serves a normal greedy request with exactly `model.generate`'s tokens. A value that is valid for an
argument (`request_id=None` asks for an automatic id, `timeout=2.5` is a timeout) is not hostile there and is skipped.

The loop defends itself too: whatever another piece of code puts on its queues is dropped with a log line, and the
loop goes on serving.

One manager serves the whole module (started once). Its model is built here from conftest's factory rather than taken
from `tiny_model`, so conftest's per-test reset of the shared tiny models never touches the model while it is bound.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import cbcore
from cbcore import RequestStatus
from conftest import MODEL_FACTORIES, greedy_config, random_prompts, reference_tokens

MAX_NEW_TOKENS = 4
PROMPT = random_prompts([9], seed=401)[0]
WAIT_S = 60.0

HOSTILE = {
    "none": None,
    "int": 12345,
    "float": 2.5,
    "tuple": (1, "a"),
    "bytes": b"req_0",
    "nested_list": [[1, [2]], [3]],
    "float_tensor": torch.ones(3),  # the wrong dtype for token ids
    "int_tensor_3d": torch.ones(1, 2, 2, dtype=torch.long),  # the wrong shape for anything
}


@dataclasses.dataclass
class Served:
    model: torch.nn.Module
    manager: cbcore.ContinuousBatchingManager
    expected: list[int]  # `model.generate`'s tokens for PROMPT


@pytest.fixture(scope="module")
def module_served() -> Iterator[Served]:
    torch.manual_seed(1234)
    model = MODEL_FACTORIES["llama_gqa"]().eval()
    model.generation_config.pad_token_id = 0
    expected = reference_tokens(model, PROMPT, greedy_config(MAX_NEW_TOKENS))
    cbcore.enable(model)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(MAX_NEW_TOKENS),
                                               cbcore.ContinuousBatchingConfig(page_size=4))
    manager.start()
    yield Served(model, manager, expected)
    manager.stop(block=True, timeout=WAIT_S)
    manager.destroy()
    assert model.config._attn_implementation == "sdpa"


@pytest.fixture
def served(module_served: Served) -> Served:
    """The module's manager, running: a test that killed its loop fails alone, the next one gets it restarted."""
    if not module_served.manager.is_running():
        module_served.manager.start()
    return module_served


def assert_serves_exactly(served: Served) -> None:
    """The manager is alive and serves PROMPT with `model.generate`'s tokens; nothing else is left to read."""
    manager = served.manager
    assert manager.is_running(), f"the loop died: {manager.background_thread_status.fatal_error!r}"
    assert manager.background_thread_status.fatal_error is None
    request_id = manager.add_request(PROMPT)
    output = manager.get_result(request_id, timeout=WAIT_S)
    assert output is not None, "no output"
    assert output.status == RequestStatus.FINISHED, output.error
    assert output.generated_tokens == served.expected
    assert manager.output_router.empty(), "an output of a refused call was delivered"


# ---- the public methods, each with a valid call and the hostile values each argument accepts as valid -------------


@dataclasses.dataclass(frozen=True)
class Method:
    """How to call one public method: `call(served, **arguments)`, the valid arguments it is called with, and for each
    argument the names of the HOSTILE values that are valid there. A method without arguments gets the hostile value
    as an extra positional argument."""

    call: Callable[..., Any]
    valid: Callable[[Served], dict[str, Any]] = lambda served: {}
    accepts: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)


def _no_arguments(name: str) -> Method:
    return Method(call=lambda served, *extra: getattr(served.manager, name)(*extra))


def _mixin_no_arguments(name: str) -> Method:
    return Method(call=lambda served, *extra: getattr(served.model, name)(*extra))


NONE, INT, FLOAT = frozenset({"none"}), frozenset({"int"}), frozenset({"float"})

MANAGER_METHODS = {
    "ContinuousBatchingManager": Method(
        call=lambda served, **kw: cbcore.ContinuousBatchingManager(**kw),
        valid=lambda served: dict(model=served.model, generation_config=greedy_config(MAX_NEW_TOKENS),
                                  continuous_batching_config=None, workload_hints=None, tokenizer=None),
        accepts={"continuous_batching_config": NONE, "workload_hints": NONE, "tokenizer": NONE},
    ),
    "add_request": Method(
        call=lambda served, **kw: served.manager.add_request(**kw),
        valid=lambda served: dict(input_ids=[1, 2, 3], request_id=None, max_new_tokens=2, streaming=False,
                                  record_timestamps=False, eos_token_id=None, structured_output=None),
        # An integer tensor of any shape is a set of EOS ids; no structured_output is no constraint.
        accepts={"request_id": NONE, "max_new_tokens": NONE | INT,
                 "eos_token_id": NONE | INT | {"int_tensor_3d"}, "structured_output": NONE},
    ),
    "add_requests": Method(
        call=lambda served, **kw: served.manager.add_requests(**kw),
        valid=lambda served: dict(inputs=[[1, 2, 3]], max_new_tokens=2, streaming=False, record_timestamps=False),
        accepts={"max_new_tokens": NONE | INT},
    ),
    "score": Method(
        call=lambda served, **kw: served.manager.score(**kw),
        valid=lambda served: dict(prompts=[[1, 2, 3]], continuations=[[4]], timeout=WAIT_S),
        accepts={"timeout": NONE | INT | FLOAT},
    ),
    "update_weights": Method(
        call=lambda served, **kw: served.manager.update_weights(**kw),
        valid=lambda served: dict(weights={}, mode="keep", timeout=None),
        accepts={"timeout": NONE | INT | FLOAT},
    ),
    "load_weights": Method(
        call=lambda served, **kw: served.manager.load_weights(**kw),
        valid=lambda served: dict(path="/nonexistent/checkpoint", mode="keep", timeout=None),
        accepts={"timeout": NONE | INT | FLOAT},
    ),
    "sleep": Method(
        call=lambda served, **kw: served.manager.sleep(**kw),
        valid=lambda served: dict(mode="abort", offload_weights=False, timeout=WAIT_S),
        accepts={"timeout": NONE | INT | FLOAT},
    ),
    "cancel_request": Method(
        call=lambda served, **kw: served.manager.cancel_request(**kw),
        valid=lambda served: dict(request_id="no_such_request"),
    ),
    "get_result": Method(
        call=lambda served, **kw: served.manager.get_result(**kw),
        valid=lambda served: dict(request_id="no_such_request", timeout=0),
        accepts={"request_id": NONE, "timeout": NONE | INT | FLOAT},
    ),
    "request_id_iter": Method(
        call=lambda served, **kw: served.manager.request_id_iter(**kw),
        valid=lambda served: dict(request_id="no_such_request"),
    ),
    "register_result_handler": Method(
        call=lambda served, **kw: served.manager.register_result_handler(**kw),
        valid=lambda served: dict(request_id="no_such_request", callback=print),
    ),
    "switch_to_cb_friendly_attn": Method(
        call=lambda served, **kw: served.manager.switch_to_cb_friendly_attn(**kw),
        valid=lambda served: dict(model=served.model, auto_switch_to_flash=True),
    ),
    "stop": Method(
        call=lambda served, **kw: served.manager.stop(**kw),
        valid=lambda served: dict(block=True, timeout=WAIT_S, keep_for_next_session=False, hard_stop=False),
        accepts={"timeout": NONE | INT | FLOAT},
    ),
    "join": Method(
        call=lambda served, **kw: served.manager.join(**kw),
        # timeout=0: a join that wrongly accepted a hostile value returns at once rather than wait for the loop.
        valid=lambda served: dict(stop_trigger_time=None, timeout=0),
        accepts={"stop_trigger_time": NONE | INT | FLOAT, "timeout": NONE | INT | FLOAT},
    ),
    **{name: _no_arguments(name) for name in ("start", "warmup", "pause", "destroy", "is_running", "check_invariants",
                                              "stats", "__iter__", "reset_prefix_cache", "wake_up")},
}

MIXIN_METHODS = {
    "init_continuous_batching": Method(
        call=lambda served, **kw: served.model.init_continuous_batching(**kw),
        valid=lambda served: dict(generation_config=None, continuous_batching_config=None, workload_hints=None),
        accepts={"generation_config": NONE, "continuous_batching_config": NONE, "workload_hints": NONE},
    ),
    # Called, never entered: a check that let a hostile value through would fail on entering or leaving the block.
    "continuous_batching_context_manager": Method(
        call=lambda served, **kw: served.model.continuous_batching_context_manager(**kw),
        valid=lambda served: dict(generation_config=None, block=True, timeout=None, continuous_batching_config=None,
                                  persistent_manager=False, warmup=True, workload_hints=None),
        accepts={"generation_config": NONE, "timeout": NONE | INT | FLOAT, "continuous_batching_config": NONE,
                 "workload_hints": NONE},
    ),
    "generate_batch": Method(
        call=lambda served, **kw: served.model.generate_batch(**kw),
        valid=lambda served: dict(inputs=[[1, 2, 3]], generation_config=greedy_config(2),
                                  continuous_batching_config=None, record_timestamps=False, progress_bar=False,
                                  persistent_manager=False, warmup=True, max_new_tokens=2),
        accepts={"generation_config": NONE, "continuous_batching_config": NONE, "max_new_tokens": NONE | INT},
    ),
    "destroy_cached_continuous_batching_manager": _mixin_no_arguments("destroy_cached_continuous_batching_manager"),
}


def _hostile_calls(method: Method, served: Served, value: Any, value_name: str) -> list[tuple[str, Callable]]:
    """(argument, call) for every argument of `method` in which `value` is hostile."""
    valid = method.valid(served)
    if not valid:
        return [("", lambda: method.call(served, value))]
    return [
        (argument, lambda argument=argument: method.call(served, **{**valid, argument: value}))
        for argument in valid
        if value_name not in method.accepts.get(argument, frozenset())
    ]


def _assert_refused(name: str, method: Method, served: Served, value_name: str) -> None:
    for argument, call in _hostile_calls(method, served, HOSTILE[value_name], value_name):
        label = re.escape(name.removeprefix("__").removesuffix("__")) + (rf".*\b{argument}\b" if argument else "")
        with pytest.raises((TypeError, ValueError), match=label):
            call()


@pytest.mark.parametrize("value_name", list(HOSTILE))
@pytest.mark.parametrize("name", list(MANAGER_METHODS))
def test_a_manager_method_refuses_a_hostile_argument_and_the_manager_serves_on(
    served: Served, name: str, value_name: str
) -> None:
    _assert_refused(name, MANAGER_METHODS[name], served, value_name)
    assert_serves_exactly(served)


@pytest.mark.parametrize("value_name", list(HOSTILE))
@pytest.mark.parametrize("name", list(MIXIN_METHODS))
def test_a_mixin_method_refuses_a_hostile_argument_and_the_manager_serves_on(
    served: Served, name: str, value_name: str
) -> None:
    _assert_refused(name, MIXIN_METHODS[name], served, value_name)
    assert not hasattr(served.model, "_cached_continuous_batching_manager"), "a refused call kept a manager"
    assert served.model.config._attn_implementation == cbcore.attention.ATTENTION_NAME  # still the manager's
    assert_serves_exactly(served)


def test_flags_take_the_ints_zero_and_one_that_older_code_passes_for_booleans(served: Served) -> None:
    """transformers reads its flags by truthiness, so `streaming=0` is a valid call there and must stay one here."""
    manager = served.manager
    request_id = manager.add_request(PROMPT, streaming=0, record_timestamps=1)
    output = manager.get_result(request_id, timeout=WAIT_S)
    assert output.status == RequestStatus.FINISHED and output.generated_tokens == served.expected
    assert len(output.timestamps) == len(output.generated_tokens)
    assert_serves_exactly(served)


def test_cancelling_an_unknown_str_id_is_ignored(served: Served) -> None:
    served.manager.cancel_request("never_added")
    assert_serves_exactly(served)


# ---- the loop's own defence -------------------------------------------------------------------------------------


def test_the_loop_drops_a_non_str_cancel_and_keeps_serving(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="cbcore"):
        served.manager.cancel_queue.put(12345)  # what cancel_request(12345) used to queue
        served.manager._wake_up_loop.set()
        assert_serves_exactly(served)
    assert "dropped a cancel of 12345" in caplog.text


def test_the_loop_drops_what_is_not_a_request_on_its_input_queue(served: Served,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="cbcore"):
        served.manager.input_queue.put(("not", "a", "request"))
        served.manager._wake_up_loop.set()
        assert_serves_exactly(served)
    assert "dropped tuple found on the input queue" in caplog.text


def test_the_engine_ignores_a_non_str_abort(served: Served) -> None:
    assert served.manager.engine.abort(12345) == []
