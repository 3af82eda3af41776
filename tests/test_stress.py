"""Stress: 200 requests of random lengths through a tiny cache that forces preemption, with random cancels, one pause,
prompts given as lists, tensors and numpy arrays, and bad input of every kind mixed in: bad prompts fail alone,
malformed arguments raise in `add_request` and leave nothing behind. Every request ends exactly once with the right
status, the greedy ones equal `model.generate`, cancelled ones hold a prefix of it, and the allocator's invariants
hold at the end."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

import cbcore
from conftest import VOCAB, assert_engine_clean, greedy_config, reference_tokens, tiny_model

NUM_REQUESTS = 200


@pytest.mark.parametrize("offload_gib", [0.0, 0.001], ids=["recompute", "swap_and_host_tier"])
def test_two_hundred_requests_with_cancels_a_pause_preemption_and_bad_input(offload_gib: float) -> None:
    rng = random.Random(2026)
    model = tiny_model("llama_gqa")
    # 160 tokens in all; with offload, a host pool of 0.001 GiB (512 blocks) for swap and the prefix cache's host tier.
    config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=40, max_batch_tokens=64, cpu_offload_space=offload_gib)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(12), config)

    requests: dict[str, dict] = {}
    for index in range(NUM_REQUESTS):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 40))]
        requests[f"r{index}"] = {"input_ids": prompt, "max_new_tokens": rng.randint(1, 12)}
    # Bad prompts: accepted by add_request, then fail alone with a FAILED output.
    invalid = {
        "bad_empty": {"input_ids": []},
        "bad_vocab": {"input_ids": [1, VOCAB + 5, 2]},
        "bad_too_long": {"input_ids": [3] * 170},
    }
    # Malformed arguments: add_request raises, naming the argument, and queues nothing.
    malformed = [
        ({"input_ids": [4, 5], "top_q": 0.3}, ValueError, "top_q"),
        ({"input_ids": [4, 5], "max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"input_ids": [4, 5], "max_new_tokens": "5"}, TypeError, "max_new_tokens"),
        ({"input_ids": [4, 5], "max_new_tokens": 2.5}, TypeError, "max_new_tokens"),
        ({"input_ids": [4, 5], "max_new_tokens": float("nan")}, TypeError, "max_new_tokens"),
        ({"input_ids": [4, None, 5]}, TypeError, r"input_ids\[1\]"),
        ({"input_ids": "4 5"}, TypeError, "tokenize"),
        ({"input_ids": [4, 5], "request_id": ["r"]}, TypeError, "request_id"),
        ({"input_ids": [4, 5], "eos_token_id": "2"}, TypeError, "eos_token_id"),
    ]
    ids = list(requests) + list(invalid) + [f"malformed_{i}" for i in range(len(malformed))]
    rng.shuffle(ids)
    to_cancel = set(rng.sample(list(requests), 20))

    manager.start()
    finals: dict[str, list] = {}
    try:
        for position, request_id in enumerate(ids):
            if request_id.startswith("malformed_"):
                spec, error, pattern = malformed[int(request_id.split("_")[1])]
                with pytest.raises(error, match=pattern):
                    manager.add_request(**({"request_id": request_id} | spec))
                continue
            spec = dict(requests.get(request_id) or invalid[request_id])
            if position % 3 == 1:  # the same prompt as a tensor or an array: taken as the list
                spec["input_ids"] = torch.tensor(spec["input_ids"], dtype=torch.long) if position % 2 else np.array(
                    spec["input_ids"], dtype=np.int64)
            manager.add_request(request_id=request_id, **spec)
            if position == len(ids) // 2:
                with manager.pause():
                    paused_at = manager.stats()["steps"]
                    threading.Event().wait(0.05)
                    assert manager.stats()["steps"] == paused_at
            if request_id in to_cancel and rng.random() < 0.5:
                manager.cancel_request(request_id)  # right away: usually before it runs
        for request_id in sorted(to_cancel):
            manager.cancel_request(request_id)  # the rest: while running, or already finished
        expected = set(requests) | set(invalid)
        while len(finals) < len(expected):
            output = manager.get_result(timeout=60)
            assert output is not None, f"stalled; missing {expected - set(finals)}"
            if output.is_finished():
                finals.setdefault(output.request_id, []).append(output)
    finally:
        manager.stop(block=True)

    assert all(len(outs) == 1 for outs in finals.values()), "a request ended twice"
    assert manager.output_router.empty()
    assert_engine_clean(manager)
    assert manager.num_preemptions > 0
    if offload_gib:
        stats = manager.stats()
        assert stats["swap_outs"] > 0 and stats["host_tier_kept"] > 0

    for request_id in invalid:
        output = finals[request_id][0]
        assert output.status == cbcore.RequestStatus.FAILED and request_id in output.error
    statuses = {"finished": 0, "cancelled": 0}
    for request_id, spec in requests.items():
        output = finals[request_id][0]
        want = reference_tokens(model, spec["input_ids"], greedy_config(spec["max_new_tokens"]))
        if output.status == cbcore.RequestStatus.CANCELLED:
            assert request_id in to_cancel
            assert want[: len(output.generated_tokens)] == output.generated_tokens
            statuses["cancelled"] += 1
        else:
            assert output.status == cbcore.RequestStatus.FINISHED, output.error
            assert output.generated_tokens == want, request_id
            statuses["finished"] += 1
    assert statuses["cancelled"] >= 10  # half were cancelled before they could run
