"""Property test over request arguments and config fields (hypothesis): whatever a caller passes, each request either
finishes equal to `model.generate`, fails alone with a message naming it, or raises in `add_request` naming the
argument; a config is either refused at construction naming the field or serves; the loop survives, `check()` holds,
and no thread or request is left behind."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from transformers import GenerationConfig

import cbcore
from conftest import VOCAB, assert_engine_clean, collect_outputs, reference_tokens, tiny_model

ARGUMENT_ERRORS = (TypeError, ValueError)

token = st.one_of(
    st.integers(1, VOCAB - 1),
    st.integers(1, VOCAB - 1),
    st.integers(1, VOCAB - 1),
    st.sampled_from([-1, VOCAB, None, 2.0, True, "3"]),
)
prompt = st.one_of(
    st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20),
    st.lists(token, min_size=0, max_size=12),
    st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12).map(torch.tensor),
    st.sampled_from([None, "text", 5]),
)
max_new_tokens = st.one_of(
    st.none(), st.integers(1, 6), st.integers(1, 6), st.sampled_from([0, -1, 2.5, math.nan, "4", [3]])
)
eos_token_id = st.one_of(st.none(), st.integers(1, VOCAB - 1), st.sampled_from([-1, [5, 9], "2", [None], 3.0]))
request_id = st.one_of(st.none(), st.none(), st.sampled_from(["a", "b", "req_3", ["x"], 7]))
processor_kwargs = st.one_of(
    st.just({}),
    st.just({}),
    st.fixed_dictionaries({}, optional={
        "temperature": st.sampled_from([0.7, 0.0, -1.0, math.nan, "hot"]),
        "top_k": st.sampled_from([1, 0, -2, 1.5]),
        "top_p": st.sampled_from([0.9, 1.5]),
        "tmperature": st.just(0.3),
    }),
)
request = st.fixed_dictionaries({
    "input_ids": prompt,
    "max_new_tokens": max_new_tokens,
    "eos_token_id": eos_token_id,
    "request_id": request_id,
    "kwargs": processor_kwargs,
})
config_fields = st.fixed_dictionaries({}, optional={
    "page_size": st.sampled_from([4, 8, 16, 3, "8", 8.0]),
    "num_blocks": st.sampled_from([8, 16, 64, 0, 2.5]),
    "max_batch_tokens": st.sampled_from([4, 16, 64, 0, 2.5, None]),
    "max_requests_per_batch": st.sampled_from([1, 3, 64, 0, None]),
    "scheduler_type": st.sampled_from(["fifo", "prefill_first", "lifo"]),
    "allow_block_sharing": st.sampled_from([True, False, "yes"]),
    "per_request_processors": st.sampled_from([True, False]),
    "seed": st.sampled_from([None, 0, 7, -3, "s"]),
})


@pytest.mark.filterwarnings("ignore")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=config_fields, requests=st.lists(request, min_size=1, max_size=6))
def test_any_request_finishes_exactly_fails_alone_or_raises_naming_its_argument(fields: dict, requests: list) -> None:
    model = tiny_model("llama_gqa")
    generation_config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    fields.setdefault("num_blocks", 64)
    try:
        config = cbcore.ContinuousBatchingConfig(**fields)
    except ARGUMENT_ERRORS as error:
        assert any(name in str(error) for name in fields), f"the error does not name the field: {error}"
        return
    manager = cbcore.ContinuousBatchingManager(model, generation_config, config)
    manager.start()
    accepted: dict[str, dict] = {}
    try:
        for spec in requests:
            call = {k: v for k, v in spec.items() if k != "kwargs"} | spec["kwargs"]
            try:
                rid = manager.add_request(**call)
            except ARGUMENT_ERRORS as error:
                message = str(error)
                named = ("input_ids", "max_new_tokens", "eos_token_id", "request_id", "duplicate", *spec["kwargs"])
                assert any(name in message for name in named), f"the error names no argument: {message}"
                continue
            accepted[rid] = spec
        outputs = collect_outputs(manager, list(accepted), timeout=120)
    finally:
        manager.stop(block=True, timeout=60)
    assert not manager.is_running()
    assert_engine_clean(manager)
    for rid, spec in accepted.items():
        output = outputs[rid]
        if output.status == cbcore.RequestStatus.FAILED:
            assert rid in output.error
            continue
        assert output.status == cbcore.RequestStatus.FINISHED, output
        if spec["kwargs"]:
            continue  # sampled: no greedy reference
        ids = spec["input_ids"].tolist() if isinstance(spec["input_ids"], torch.Tensor) else spec["input_ids"]
        limit = spec["max_new_tokens"] or generation_config.max_new_tokens
        eos = spec["eos_token_id"]
        reference = GenerationConfig(max_new_tokens=limit, do_sample=False, pad_token_id=0,
                                     eos_token_id=eos)
        assert output.generated_tokens == reference_tokens(model, ids, reference), rid
