"""One rank of the tensor-parallel tests (tests/test_tensor_parallel.py runs two of these as processes).

Every rank runs the same scenarios in the same order, as a user's script under `torchrun` would: it loads the saved
tiny model with transformers' tensor-parallel plan (`tp_plan="auto"`: gloo on CPU, NCCL on GPUs), builds a manager,
and the driver (rank 0) adds the requests. Each rank writes what it saw to `<out>/rank<r>.json`; the test compares
the driver's tokens with `model.generate` in the test's own process. Every wait here is bounded: a hang fails the
test (the parent kills the processes) instead of blocking it.

    python tests/tp_worker.py <scenario> <model dir> <out dir>      # with RANK, WORLD_SIZE, MASTER_* set
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

WAIT_S = 60.0  # the longest any single wait in a scenario may take

# Prompts: token ids of the tiny model's vocabulary (never 0, the pad id). Chunked prefill: longer than the step's
# token budget (16). Prefix sharing: two prompts that share their first 16 tokens (4 full pages of 4).
SHARED = [7, 3, 91, 45, 12, 66, 30, 2, 58, 14, 80, 9, 33, 71, 25, 40]
CHUNKED_PROMPTS = [
    [(11 * i) % 95 + 1 for i in range(37)],
    [(7 * i + 3) % 95 + 1 for i in range(23)],
    SHARED + [5, 6, 7],
    SHARED + [60, 61],
    [4, 8, 15, 16, 23],
]
CHUNKED_NEW_TOKENS = 10
# Preemption: more than the small cache (12 blocks of 4 tokens) holds at once.
PREEMPT_PROMPTS = [[(5 * i + k) % 95 + 1 for i in range(10)] for k in range(4)]
PREEMPT_NEW_TOKENS = 14
CANCELLED_PROMPT = [9, 9, 8, 7, 6]
PAUSE_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
PAUSE_NEW_TOKENS = 24


def _load(model_dir: str, backend: str):
    from transformers import AutoModelForCausalLM

    import cbcore

    # transformers picks the backend's device itself (gloo: CPU; NCCL: cuda:LOCAL_RANK) and shards the layers.
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
    return cbcore.enable(model.eval())


def _greedy(max_new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


def _collect(manager, request_ids: list[str]) -> dict[str, dict]:
    """Every request's terminal output (tokens, status, error), bounded by WAIT_S."""
    finals: dict[str, dict] = {}
    deadline = time.monotonic() + WAIT_S
    while len(finals) < len(request_ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"still waiting for {set(request_ids) - set(finals)}")
        output = manager.get_result(timeout=1)
        if output is not None and output.is_finished():
            if output.request_id in finals:
                raise AssertionError(f"{output.request_id} got two terminal outputs")
            finals[output.request_id] = {
                "tokens": list(output.generated_tokens),
                "status": int(output.status),
                "error": output.error,
            }
    return finals


def _engine_clean(manager) -> bool:
    """No block referenced once every request ended, and the allocator's invariants hold (the driver's cache)."""
    manager.check_invariants()
    return manager.cache.allocator.num_referenced == 0


def _wait_until_stopped(manager) -> None:
    deadline = time.monotonic() + WAIT_S
    while manager.is_running():
        if time.monotonic() > deadline:
            raise TimeoutError("the loop did not end")
        time.sleep(0.05)


def serve(model_dir: str, backend: str, rank: int, sync) -> dict:
    """Parity across chunked prefill, prefix sharing, preemption and a cancel; non-driver add_request; a pause
    entered on every rank; a hard stop (from the driver, then from the other rank)."""
    import cbcore
    from cbcore.requests import RequestStatus

    model = _load(model_dir, backend)
    seen: dict = {}

    # 1. generate_batch: chunked prefill (prompts longer than max_batch_tokens) and prefix sharing.
    config = cbcore.ContinuousBatchingConfig(num_blocks=64, page_size=4, max_batch_tokens=16, cpu_offload_space=0,
                                             cpu_group_timeout=30)
    outputs = model.generate_batch(CHUNKED_PROMPTS, generation_config=_greedy(CHUNKED_NEW_TOKENS),
                                   continuous_batching_config=config, persistent_manager=True)
    manager = model._cached_continuous_batching_manager
    seen["chunked"] = {rid: list(out.generated_tokens) for rid, out in outputs.items()}
    seen["chunked_stats"] = manager.stats() if rank == 0 else {}
    seen["chunked_clean"] = _engine_clean(manager) if rank == 0 else None
    model.destroy_cached_continuous_batching_manager()

    # 2. A small cache (preemption, with a host pool to swap to) and a cancel.
    config = cbcore.ContinuousBatchingConfig(num_blocks=12, page_size=4, max_batch_tokens=32, cpu_offload_space=0.001,
                                             cpu_group_timeout=30)
    manager = cbcore.ContinuousBatchingManager(model, _greedy(PREEMPT_NEW_TOKENS), config)
    manager.start()
    seen["follower_add_request"] = repr(manager.add_request([1, 2, 3])) if rank != 0 else None
    seen["follower_add_requests"] = repr(manager.add_requests([[1, 2, 3]])) if rank != 0 else None
    if rank == 0:
        doomed = manager.add_request(CANCELLED_PROMPT, max_new_tokens=200, streaming=True)
        first = manager.get_result(doomed, timeout=WAIT_S)
        assert first is not None and not first.is_finished(), "the request to cancel ended before it could be"
        request_ids = manager.add_requests(PREEMPT_PROMPTS)
        manager.cancel_request(doomed)
        finals = _collect(manager, request_ids + [doomed])
        seen["preempt"] = {rid: finals[rid]["tokens"] for rid in request_ids}
        seen["cancelled_status"] = finals[doomed]["status"]
    else:
        manager.cancel_request("req_0")  # a no-op here
    manager.stop(block=True, timeout=WAIT_S)
    if rank == 0:
        seen["preempt_stats"] = manager.stats()
        seen["preempt_clean"] = _engine_clean(manager)
    manager.destroy()

    # 3. A pause entered on every rank, while a request runs: it resumes and finishes as if never paused. Inside it
    # rank 1 alone changes a weight in place (same values, a new version): its K/V shard is stale, so the driver's
    # prefix cache must be dropped too. Before the pause, the same prompt twice shows that it would be shared.
    config = cbcore.ContinuousBatchingConfig(num_blocks=32, page_size=4, cpu_offload_space=0, cpu_group_timeout=30)
    manager = cbcore.ContinuousBatchingManager(model, _greedy(PAUSE_NEW_TOKENS), config)
    manager.start()
    if rank == 0:
        _collect(manager, [manager.add_request(PAUSE_PROMPT, max_new_tokens=2)])
        _collect(manager, [manager.add_request(PAUSE_PROMPT, max_new_tokens=2)])
        seen["hits_before_pause"] = manager.stats()["prefix_hit_tokens"]
        paused_id = manager.add_request(PAUSE_PROMPT, streaming=True)
        assert manager.get_result(paused_id, timeout=WAIT_S) is not None
    dist.barrier(group=sync)
    with manager.pause():
        seen["parked_in_pause"] = manager._loop_parked
        if rank == 1:
            with torch.no_grad():
                model.model.norm.weight.mul_(1.0)
    if rank == 0:
        seen["paused"] = _collect(manager, [paused_id])[paused_id]["tokens"]
        hits = manager.stats()["prefix_hit_tokens"]
        _collect(manager, [manager.add_request(PAUSE_PROMPT, max_new_tokens=2)])
        seen["hits_after_weight_change"] = manager.stats()["prefix_hit_tokens"] - hits
    manager.stop(block=True, timeout=WAIT_S)
    seen["stopped_after_pause"] = not manager.is_running()
    manager.destroy()

    # 4. Hard stops: asked on the driver, then on the other rank; each ends the group's loops at once, and the
    # driver's request ends FAILED with what it had generated.
    for asking in (0, 1):
        config = cbcore.ContinuousBatchingConfig(num_blocks=64, page_size=4, cpu_offload_space=0, cpu_group_timeout=30)
        manager = cbcore.ContinuousBatchingManager(model, _greedy(10_000), config)
        manager.start()
        if rank == 0:
            long_id = manager.add_request(PAUSE_PROMPT, max_new_tokens=200, streaming=True)
            assert manager.get_result(long_id, timeout=WAIT_S) is not None
        dist.barrier(group=sync)
        if rank == asking:
            manager.stop(block=True, timeout=WAIT_S, hard_stop=True)
        _wait_until_stopped(manager)
        if rank == 0:
            final = _collect(manager, [long_id])[long_id]
            seen[f"hard_stop_from_{asking}"] = final["status"] == int(RequestStatus.FAILED) and final["error"]
        else:
            seen[f"hard_stop_from_{asking}"] = manager.background_thread_status.fatal_error is None
        # The same managers serve a next session: the hard stop asked in the last one is not asked again.
        manager.start()
        if rank == 0:
            again = manager.add_request(PAUSE_PROMPT, max_new_tokens=3)
            seen[f"served_after_hard_stop_from_{asking}"] = _collect(manager, [again])[again]["tokens"]
        manager.stop(block=True, timeout=WAIT_S)
        manager.destroy()
    return seen


def pause_on_one_rank(model_dir: str, backend: str, rank: int, sync) -> dict:
    """The driver enters pause(), the other rank never does: both loops end with a clear error, bounded by
    cpu_group_timeout."""
    import cbcore

    model = _load(model_dir, backend)
    timeout = 4.0
    config = cbcore.ContinuousBatchingConfig(num_blocks=32, page_size=4, cpu_offload_space=0, cpu_group_timeout=timeout)
    manager = cbcore.ContinuousBatchingManager(model, _greedy(10_000), config)
    manager.start()
    seen: dict = {"timeout": timeout}
    if rank == 0:
        request_id = manager.add_request(PAUSE_PROMPT, max_new_tokens=500, streaming=True)
        assert manager.get_result(request_id, timeout=WAIT_S) is not None
    dist.barrier(group=sync)
    started = time.monotonic()
    if rank == 0:
        with manager.pause():
            time.sleep(0.2)
    _wait_until_stopped(manager)
    seen["seconds_to_error"] = time.monotonic() - started
    error = manager.background_thread_status.fatal_error
    seen["error_type"] = type(error).__name__
    seen["error"] = str(error)
    if rank == 0:
        seen["request_status"] = _collect(manager, [request_id])[request_id]["status"]
    try:
        manager.start()
    except RuntimeError as refusal:
        seen["restart_refused"] = str(refusal)
    manager.destroy()
    return seen


def _fail_one_forward(model_dir: str, backend: str, rank: int, cpu_group_timeout: float, inject) -> dict:
    """Start a manager on every rank, let `inject(manager, model)` (called on the failing rank only) make one of its
    forwards raise, serve one request from the driver and wait for both loops to end: what each rank saw (the
    driver: its request's status and error, and how long it took to end)."""
    import cbcore

    model = _load(model_dir, backend)
    config = cbcore.ContinuousBatchingConfig(num_blocks=32, page_size=4, cpu_offload_space=0,
                                             cpu_group_timeout=cpu_group_timeout)
    manager = cbcore.ContinuousBatchingManager(model, _greedy(10_000), config)
    manager.start()
    if inject is not None:
        inject(manager, model)
    seen: dict = {}
    if rank == 0:
        started = time.monotonic()
        request_id = manager.add_request(PAUSE_PROMPT, max_new_tokens=50)
        final = _collect(manager, [request_id])[request_id]
        seen["elapsed_s"] = time.monotonic() - started
        seen["request_status"], seen["request_error"] = final["status"], final["error"]
    _wait_until_stopped(manager)
    seen["error"] = str(manager.background_thread_status.fatal_error)
    manager.destroy()
    return seen


def _raise_on_third_call(rank: int):
    """A function that raises this rank's injected failure on its third call."""
    calls = []

    def maybe_raise() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError(f"injected failure on rank {rank}")
    return maybe_raise


def failure_on_one_rank(model_dir: str, backend: str, rank: int, sync) -> dict:
    """Rank 1's forward raises after its collectives (the driver's does not): the driver's requests end FAILED
    naming rank 1's error, and both loops end."""
    def after_the_forward(manager, model):
        runner = manager.engine.runner
        real_forward, maybe_raise = runner.forward, _raise_on_third_call(rank)

        def failing_forward(plan, step_hook=None):
            result = real_forward(plan, step_hook)  # every collective of the step done: the driver's forward ends
            maybe_raise()
            return result

        runner.forward = failing_forward

    return _fail_one_forward(model_dir, backend, rank, 30, after_the_forward if rank == 1 else None)


FAILING_BEFORE_COLLECTIVES_TIMEOUT_S = 8


def failure_before_collectives(failing_rank: int, model_dir: str, backend: str, rank: int, sync) -> dict:
    """`failing_rank`'s forward raises before its first collective, which the other rank's forward enters and
    waits in: both ranks end with the same error, which says the group is out of step, within cpu_group_timeout
    (far sooner than the world group's WAIT_S timeout, which the blocked collective would otherwise wait out)."""
    def before_the_collectives(manager, model):
        maybe_raise = _raise_on_third_call(rank)
        # The embedding runs before any of the forward's collectives.
        model.get_input_embeddings().register_forward_pre_hook(lambda module, args: maybe_raise())

    return _fail_one_forward(model_dir, backend, rank, FAILING_BEFORE_COLLECTIVES_TIMEOUT_S,
                             before_the_collectives if rank == failing_rank else None)


SCENARIOS = {"serve": serve, "pause_on_one_rank": pause_on_one_rank, "failure_on_one_rank": failure_on_one_rank,
             "failure_before_collectives_on_rank0": functools.partial(failure_before_collectives, 0),
             "failure_before_collectives_on_rank1": functools.partial(failure_before_collectives, 1)}


def main() -> None:
    scenario, model_dir, out_dir = sys.argv[1:4]
    backend = os.environ.get("CBCORE_TP_BACKEND", "gloo")
    torch.set_num_threads(1)  # two ranks share two cores
    if backend == "nccl":  # each rank on its own GPU before the group exists (NCCL binds the current device)
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=WAIT_S))
    rank = dist.get_rank()
    sync = dist.new_group(backend="gloo")  # the script's own barriers: never on a group the loops use
    result: dict = {}
    try:
        result = SCENARIOS[scenario](model_dir, backend, rank, sync)
        result["ok"] = True
    except BaseException:  # noqa: BLE001 - reported to the test
        result["ok"] = False
        result["traceback"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
