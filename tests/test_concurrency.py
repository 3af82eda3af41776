"""Several threads at once on one manager, for a bounded time: adders (some cancelling their own requests right after
adding them, some cancelling each other's), a pauser, a reader waiting on particular ids, and one thread that stops
the manager at the end. Afterwards every accepted request has exactly one terminal output, the finished ones equal
`model.generate`, no call hung (every wait has a timeout) and no block leaked."""

from __future__ import annotations

import random
import threading
import time

import cbcore
from conftest import VOCAB, assert_engine_clean, greedy_config, reference_tokens, tiny_model

RUN_S = 4.0  # how long the adders keep adding
REQUESTS_PER_ADDER = 40  # and at most this many each, so the flush at stop() stays short
JOIN_S = 60.0  # the most any thread may take to finish after that


def test_threads_adding_cancelling_pausing_reading_and_stopping_lose_nothing() -> None:
    model = tiny_model("llama_gqa")
    config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=48, max_batch_tokens=48)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(8), config)
    manager.start()

    lock = threading.Lock()
    accepted: dict[str, tuple[list[int], int]] = {}  # id -> (prompt, max_new_tokens)
    finals: dict[str, list[cbcore.GenerationOutput]] = {}
    errors: list[BaseException] = []
    deadline = time.monotonic() + RUN_S
    stopping = threading.Event()

    def record(output: cbcore.GenerationOutput) -> None:
        if output.is_finished():
            with lock:
                finals.setdefault(output.request_id, []).append(output)

    def adder(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(REQUESTS_PER_ADDER):
                if time.monotonic() >= deadline:
                    return
                prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 24))]
                max_new = rng.randint(1, 8)
                try:
                    request_id = manager.add_request(prompt, max_new_tokens=max_new)
                except RuntimeError:  # the stopper began: refused loudly, never silently dropped
                    assert stopping.is_set()
                    return
                with lock:
                    accepted[request_id] = (prompt, max_new)
                    others = list(accepted)
                roll = rng.random()
                if roll < 0.2:
                    manager.cancel_request(request_id)  # right after adding it
                elif roll < 0.3:
                    manager.cancel_request(rng.choice(others))  # someone else's, in any state
                elif roll < 0.35:
                    manager.cancel_request(f"no_such_{seed}")
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    def pauser() -> None:
        try:
            while time.monotonic() < deadline:
                with manager.pause():
                    steps = manager.stats()["steps"]
                    assert manager.stats()["steps"] == steps  # parked: no step runs inside the pause
                time.sleep(0.05)  # let the loop run between pauses (pacing, not synchronisation)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    def reader() -> None:
        """Reads every output; every so often waits for one particular id instead of the next in line."""
        rng = random.Random(99)
        try:
            while manager.is_running() or not manager.output_router.empty():
                with lock:
                    pending = [rid for rid in accepted if rid not in finals]
                if pending and rng.random() < 0.3:
                    output = manager.get_result(request_id=rng.choice(pending), timeout=0.2)
                else:
                    output = manager.get_result(timeout=0.2)
                if output is not None:
                    record(output)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    def stopper() -> None:
        try:
            while time.monotonic() < deadline:
                time.sleep(0.05)
            stopping.set()
            manager.stop(block=True, timeout=JOIN_S)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=adder, args=(seed,)) for seed in range(3)]
    threads += [threading.Thread(target=pauser), threading.Thread(target=reader), threading.Thread(target=stopper)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(RUN_S + JOIN_S)
        assert not thread.is_alive(), f"{thread.name} hung"
    assert not errors, errors
    assert not manager.is_running()

    assert set(finals) == set(accepted), f"missing outputs: {set(accepted) - set(finals)}"
    assert all(len(outputs) == 1 for outputs in finals.values()), "a request ended twice"
    assert len(accepted) > 20
    cancelled = 0
    for request_id, (prompt, max_new) in accepted.items():
        output = finals[request_id][0]
        want = reference_tokens(model, prompt, greedy_config(max_new))
        if output.status == cbcore.RequestStatus.CANCELLED:
            cancelled += 1
            assert want[: len(output.generated_tokens)] == output.generated_tokens
        else:
            assert output.status == cbcore.RequestStatus.FINISHED, output.error
            assert output.generated_tokens == want, request_id
    assert cancelled > 0
    assert_engine_clean(manager)
