"""`ContinuousBatchingManager`: the background loop, its queues, request validation and output routing.

One background thread owns all engine state (scheduler, cache, runner). Public methods may be called from any
thread; they only talk to the loop through queues and events. Each loop iteration: take in new requests (validating
each: a bad one fails alone), apply cancellations, ask the scheduler for a step, run it, advance the requests and
deliver outputs. Every request ends with exactly one terminal output: FINISHED, FAILED or CANCELLED.

Mirrors transformers 5.24's `ContinuousBatchingManager` (same constructor, methods, argument names and defaults);
the differences are listed in the README and DESIGN.md §7.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from . import attention
from .cache import CacheShape, PagedKVCache, plan_num_blocks, useful_blocks
from .config import ContinuousBatchingConfig, as_cbcore_config
from .linear import PackedLinears
from .outputs import OutputRouter
from .requests import GenerationOutput, RequestState, RequestStatus
from .runner import ModelRunner
from .sampling import Sampler
from .scheduler import SCHEDULING_ORDERS, ScheduledBatch, Scheduler
from .swap import plan_num_host_blocks

logger = logging.getLogger("cbcore")

# Default step budgets when the config leaves them None (transformers infers them from GPU memory).
DEFAULT_MAX_BATCH_TOKENS = {"cpu": 1024, "cuda": 8192}
FALLBACK_MAX_REQUESTS_PER_BATCH = 1024  # transformers' fallback
CPU_MAX_MEMORY_PERCENT = 0.6  # transformers' default on CPU; cbcore also caps the bytes (cache.CPU_CACHE_CAP_BYTES)
# How long add_request waits for room in a full input queue (max_queue_size) before raising queue.Full, as transformers.
ADD_REQUEST_TIMEOUT_S = 10.0


class _StopMode:
    RUNNING = 0
    FLUSH = 1  # finish everything queued, then stop
    HARD = 2  # fail whatever is pending, stop now


class ContinuousBatchingManager:
    """Serves generation requests with continuous batching on a background thread.

    Create it directly or through `model.init_continuous_batching()` after `cbcore.enable(model)`:

        manager = ContinuousBatchingManager(model, GenerationConfig(max_new_tokens=32), ContinuousBatchingConfig())
        manager.start()
        request_id = manager.add_request([1, 2, 3])
        output = manager.get_result(request_id, timeout=10)
        manager.stop()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: GenerationConfig,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        workload_hints: WorkloadHints | None = None,
    ) -> None:
        # Work on copies: the caller's configs are never mutated (transformers writes eos_token_id=-1 into them).
        self.generation_config = GenerationConfig.from_dict(generation_config.to_dict())
        self.continuous_batching_config = as_cbcore_config(continuous_batching_config)
        self.workload_hints = workload_hints
        self.model = model.eval()
        self.continuous_batching_config.check_supported(model.device)
        self.default_eos_token_id = self._resolve_default_eos()
        num_return_sequences = getattr(self.generation_config, "num_return_sequences", None)
        self.num_return_sequences = num_return_sequences if num_return_sequences is not None else 1

        self.input_queue: queue.Queue[RequestState] = queue.Queue(
            maxsize=self.continuous_batching_config.max_queue_size
        )
        self.cancel_queue: queue.Queue[str] = queue.Queue()
        self.output_router = OutputRouter()
        self._request_counter = 0
        self._request_lock = threading.Lock()
        self._wake_up_loop = threading.Event()
        self._stop_mode = _StopMode.RUNNING
        self._generation_thread: threading.Thread | None = None
        self._fatal_error: BaseException | None = None
        # Pause: callers hold it (a count, several at once); the loop parks at a step boundary while it is held.
        self._pause_cond = threading.Condition()
        self._pause_holders = 0
        self._loop_parked = False
        self._pause_owner = threading.local()

        # Engine state, built on first use (warmup or start) and owned by the loop thread afterwards.
        self.cache: PagedKVCache | None = None
        self.scheduler: Scheduler | None = None
        self.runner: ModelRunner | None = None
        self._live_ids: set[str] = set()
        self.warmed_up = False
        self._counters = {
            "steps": 0,
            "computed_tokens": 0,
            "computed_prompt_tokens": 0,
            "recomputed_tokens": 0,
            "generated_tokens": 0,
        }

        # The model's attention is switched by start() and restored by stop(): a manager that is built but never
        # started leaves the model untouched (transformers switches it in __init__).
        self._original_attn_impl: str | None = None
        # On CPU, start() also runs the model's linear layers on prepacked oneDNN weights during cbcore's steps
        # (cbcore/linear.py); stop() gives them back.
        self._packed_linears: PackedLinears | None = None
        # The parameters' in-place version counters when the loop last looked (see _notice_weight_changes).
        self._weights_signature: int | None = None
        self._use_prefix_sharing = self.continuous_batching_config.allow_block_sharing

    # ------------------------------------------------------------------------------------------------ set-up ----

    def switch_to_cb_friendly_attn(self, model: torch.nn.Module, auto_switch_to_flash: bool = True) -> None:
        """Point the model's attention at cbcore's paged attention (restored by `stop`). cbcore always uses its own
        paged kernels, so `auto_switch_to_flash` has no effect. Idempotent."""
        name = attention.register()
        current = model.config._attn_implementation
        if current != name and self._original_attn_impl is None:
            model.set_attn_implementation(name)
            self._original_attn_impl = current

    def _resolve_default_eos(self) -> int | list[int]:
        """EOS for requests that give none, as `model.generate` resolves it: the generation config, then the model's
        generation config, then the model config; -1 (none) if all are unset. (transformers' manager instead writes
        -1 into the caller's config, so its requests ignore the model's EOS.)"""
        for source in (self.generation_config, getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                return eos
        return -1

    def _restore_attn(self) -> None:
        """Undo what `start()` did to the model: its attention implementation and the packed linear layers."""
        if self._packed_linears is not None:
            self._packed_linears.detach()
            self._packed_linears = None
        if self._original_attn_impl is not None:
            self.model.set_attn_implementation(self._original_attn_impl)
            self._original_attn_impl = None

    def _build_engine(self) -> None:
        """Size and allocate the cache, and build the scheduler, sampler and runner."""
        cfg = self.continuous_batching_config
        device = self.model.device
        shape = CacheShape.from_model_config(self.model.config, self.model.dtype)
        hints = self.workload_hints
        max_requests = cfg.max_requests_per_batch
        if max_requests is None:
            wanted = hints.num_requests if hints is not None and hints.num_requests > 0 else None
            max_requests = min(wanted or FALLBACK_MAX_REQUESTS_PER_BATCH, FALLBACK_MAX_REQUESTS_PER_BATCH)
        max_batch_tokens = cfg.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS.get(device.type, 2048)
        num_blocks = cfg.num_blocks
        if num_blocks is None:
            percent = cfg.max_memory_percent or (CPU_MAX_MEMORY_PERCENT if device.type != "cuda" else 0.9)
            useful = None
            if hints is not None and hints.num_requests > 0 and hints.max_prompt_length > 0:
                longest = hints.max_prompt_length + max(hints.max_generated_length, 1)
                useful = useful_blocks(hints.num_requests, longest, cfg.page_size)
            num_blocks = plan_num_blocks(
                shape, cfg.page_size, device, percent, self._activation_bytes(max_batch_tokens, max_requests), useful
            )
        self.cache = PagedKVCache(shape, num_blocks, cfg.page_size, device, cfg.allow_block_sharing)
        if cfg.cpu_offload_space is None or cfg.cpu_offload_space > 0:
            bytes_per_block = shape.bytes_per_token * cfg.page_size
            num_host_blocks = plan_num_host_blocks(
                cfg.cpu_offload_space, cfg.cpu_offload_space_safety_threshold, bytes_per_block
            )
            if num_host_blocks < 1:
                raise ValueError(
                    f"cpu_offload_space={cfg.cpu_offload_space} GiB holds no block of {bytes_per_block} bytes "
                    f"(after the cpu_offload_space_safety_threshold cap); raise it or set it to 0 to disable swap"
                )
            self.cache.enable_swap(num_host_blocks)
        max_requests = min(max_requests, max_batch_tokens)
        self.scheduler = Scheduler(
            self.cache,
            SCHEDULING_ORDERS[cfg.scheduler_type](),
            max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_requests,
            safety_margin=cfg.safety_margin,
        )
        # Build processors from the config exactly as `model.generate` prepares it: unset values filled from the
        # model's generation config and global defaults, special tokens as tensors (min_new_tokens needs them).
        generation_config, _ = self.model._prepare_generation_config(self.generation_config)
        self.model._prepare_special_tokens(generation_config, kwargs_has_attention_mask=True, device=device)

        def processors_for(prompt_length: int, overrides: dict):
            config = generation_config
            if overrides:
                config = copy.deepcopy(generation_config)
                for name, value in overrides.items():
                    setattr(config, name, value)
            return self.model._get_logits_processor(config, input_ids_seq_length=prompt_length, device=device)

        sampler = Sampler(generation_config, processors_for, cfg.return_logprobs, cfg.seed, cfg.per_request_processors)
        self.runner = ModelRunner(self.model, self.cache, sampler)
        # Record the resolved values, as transformers does after creating its cache.
        cfg.num_blocks, cfg.max_batch_tokens, cfg.max_requests_per_batch = num_blocks, max_batch_tokens, max_requests

    def _activation_bytes(self, max_batch_tokens: int, max_requests: int) -> int:
        """Memory one step needs besides the cache: hidden states and MLP activations for every query token, and
        fp32 logits for every emitting row (computed from the budgets; no [T, T] mask is ever built)."""
        config = self.model.config.get_text_config()
        element = torch.empty((), dtype=self.model.dtype).element_size()
        intermediate = getattr(config, "intermediate_size", 4 * config.hidden_size)
        per_token = (4 * config.hidden_size + 2 * intermediate) * element
        logits = max_requests * config.vocab_size * 4 * 2
        return max_batch_tokens * per_token + logits

    def warmup(self) -> None:
        """Build the engine (cache, scheduler, runner) ahead of the first request. cbcore has no CUDA graphs to
        capture yet, so this is all warmup does."""
        if self.cache is None:
            self._build_engine()
        self.warmed_up = True

    # ------------------------------------------------------------------------------------------- lifecycle ----

    def is_running(self) -> bool:
        """Whether the background thread has been started and is still alive."""
        return self._generation_thread is not None and self._generation_thread.is_alive()

    def start(self) -> None:
        """Start the background generation thread (building the engine first if needed)."""
        if self.is_running():
            logger.warning("Manager thread is already running.")
            return
        self.switch_to_cb_friendly_attn(self.model)
        if self._packed_linears is None and self.model.device.type == "cpu":
            self._packed_linears = PackedLinears.attach(self.model)
        if self.cache is None:
            self._build_engine()
        self._stop_mode = _StopMode.RUNNING
        self._fatal_error = None
        use_inference_mode = torch.is_inference_mode_enabled()
        loop_kwargs = {"use_inference_mode": use_inference_mode, "num_threads": torch.get_num_threads()}
        self._generation_thread = threading.Thread(
            target=self._run_generation_loop, name="cbcore-loop", kwargs=loop_kwargs, daemon=True
        )
        self._generation_thread.start()

    def stop(
        self,
        block: bool = True,
        timeout: float | None = None,
        keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:
        """Stop the loop: by default after finishing every queued request; with `hard_stop`, at once, failing what
        is pending (with its partial tokens). `block` waits up to `timeout` seconds for the thread to end.
        `keep_for_next_session` caches the manager on the model for the next `init_continuous_batching`. The model's
        original attention implementation is restored."""
        if self._generation_thread is None:
            logger.warning("Manager not started.")
            return
        if getattr(self._pause_owner, "depth", 0):
            raise RuntimeError(
                "Cannot stop the manager from inside a pause: the loop is paused and cannot exit, so this would wait "
                "forever. Leave the `pause` context before calling `stop`."
            )
        stop_trigger_time = time.perf_counter()
        self._stop_mode = _StopMode.HARD if hard_stop else _StopMode.FLUSH
        self._wake_up_loop.set()
        if block:
            self.join(stop_trigger_time, timeout)
        if keep_for_next_session:
            self.model._cached_continuous_batching_manager = self
        self._restore_attn()

    def join(self, stop_trigger_time: float, timeout: float | None = None) -> None:
        """Wait (up to `timeout` seconds) for the background thread to finish."""
        if self._generation_thread is None:
            return
        self._generation_thread.join(timeout=timeout)
        if self._generation_thread.is_alive():
            logger.warning(f"Generation thread did not exit after join timeout ({timeout}).")
        else:
            logger.info(f"Background generation thread stopped after {time.perf_counter() - stop_trigger_time:.2f}s.")
            self._generation_thread = None

    def destroy(self) -> None:
        """Stop if running and release the cache. Safe to call several times; the manager cannot restart after."""
        if self.is_running():
            self.stop(block=True)
        self._restore_attn()
        self.cache = self.scheduler = self.runner = None

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Pause the loop for the `with` block, e.g. to update the model's weights in place. The block is entered once
        the loop is parked between two steps; on exit it resumes with its cache and in-flight requests intact
        (nothing is drained, nothing lost). Several threads may hold the pause at once; the loop resumes when the last
        one leaves. Raises RuntimeError when no loop is running."""
        if not self.is_running():
            raise RuntimeError("Cannot pause generation while no generation loop is running.")
        with self._pause_cond:
            self._pause_holders += 1
        self._pause_owner.depth = getattr(self._pause_owner, "depth", 0) + 1
        self._wake_up_loop.set()
        try:
            with self._pause_cond:
                self._pause_cond.wait_for(lambda: self._loop_parked or not self.is_running())
            yield
        finally:
            self._pause_owner.depth -= 1
            with self._pause_cond:
                self._pause_holders -= 1
                self._pause_cond.notify_all()

    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], Any]) -> None:
        """Deliver this request's outputs (every snapshot when streaming, else the final one) by calling
        `callback(output)` on the running asyncio loop, through `call_soon_threadsafe`. Must be called from inside
        that loop. The handler is removed after the terminal output."""
        loop = asyncio.get_running_loop()
        self.output_router.register_handler(request_id, callback, loop)

    # -------------------------------------------------------------------------------------------- requests ----

    def add_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **logit_processor_kwargs: Any,
    ) -> str | None:
        """Queue a request; returns its id (`req_<n>` unless given). Invalid input is reported through a FAILED
        output for this request, never raised here, so a bad request cannot disturb the others. Raises `queue.Full`
        when `max_queue_size` is reached and no slot frees up within 10 s (as transformers does)."""
        if self._stop_mode != _StopMode.RUNNING and self.is_running():
            logger.warning("The manager is stopping; request dropped.")
            return None
        if request_id is None:
            with self._request_lock:
                request_id = f"req_{self._request_counter}"
                self._request_counter += 1
        max_new_tokens = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        eos_token_id = self.default_eos_token_id if eos_token_id is None else eos_token_id
        state = RequestState(
            request_id=request_id,
            initial_tokens=list(input_ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            streaming=streaming,
            record_timestamps=record_timestamps,
            num_children=self.num_return_sequences - 1,
            logit_processor_kwargs=logit_processor_kwargs,
        )
        self.input_queue.put(state, block=True, timeout=ADD_REQUEST_TIMEOUT_S)
        self._wake_up_loop.set()
        return request_id

    def add_requests(
        self,
        inputs: list[list[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        **logit_processor_kwargs: Any,
    ) -> list[str]:
        """Queue several requests; returns their ids in input order. With prefix sharing, they are queued sorted by
        content (as transformers does) so that requests sharing a prefix run one after another."""
        with self._request_lock:
            request_ids = [f"req_{i}" for i in range(self._request_counter, self._request_counter + len(inputs))]
            self._request_counter += len(inputs)
        pairs = list(zip(request_ids, inputs))
        if self._use_prefix_sharing:
            pairs = sorted(pairs, key=lambda pair: list(pair[1]), reverse=True)
        for request_id, input_ids in pairs:
            self.add_request(
                input_ids,
                request_id=request_id,
                max_new_tokens=max_new_tokens,
                streaming=streaming,
                record_timestamps=record_timestamps,
                **logit_processor_kwargs,
            )
        return request_ids

    def cancel_request(self, request_id: str) -> None:
        """Cancel a request: its blocks are freed and it ends with one CANCELLED output (transformers sends none)."""
        self.cancel_queue.put(request_id)
        self._wake_up_loop.set()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (of `request_id` when given), waiting up to `timeout` seconds. None on timeout, or when
        the loop is not running and nothing is left to read. Unlike transformers, asking for one request never
        returns None just because another request's output came first."""
        return self.output_router.get(request_id, timeout, self.is_running)

    def __iter__(self) -> Generator[GenerationOutput]:
        """Yield outputs as they arrive, while the loop runs."""
        while self.is_running() or not self.output_router.empty():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str) -> Generator[GenerationOutput]:
        """Yield the outputs of one request (snapshots when streaming) until its terminal output."""
        while self.is_running() or not self.output_router.empty():
            result = self.get_result(request_id=request_id, timeout=0.1)
            if result is not None:
                yield result
                if result.is_finished():
                    return

    # ------------------------------------------------------------------------------------ the loop thread ----

    def _run_generation_loop(self, use_inference_mode: bool, num_threads: int) -> None:
        # The caller's torch thread count, set explicitly in this thread, so the loop runs with the caller's choice
        # rather than whatever OpenMP gives a new thread. (Some runs here measured torch ops 20-35% slower in a new
        # thread without it; bench/test_bench_linear.py::test_threads tracks it, and it does not always reproduce.)
        torch.set_num_threads(num_threads)
        try:
            with torch.inference_mode(use_inference_mode):
                while True:
                    self._park_while_paused()
                    self._take_new_requests()
                    self._apply_cancellations()
                    if self._stop_mode == _StopMode.HARD:
                        self._end_all("the manager was stopped with hard_stop=True before this request finished")
                        break
                    if not self.scheduler.has_work():
                        if self._stop_mode == _StopMode.FLUSH and self.input_queue.empty():
                            break
                        self._wake_up_loop.wait(timeout=0.1)
                        self._wake_up_loop.clear()
                        continue
                    self._notice_weight_changes()
                    self._step()
        except BaseException as error:  # noqa: BLE001 - the loop must report, not vanish
            logger.exception("cbcore generation loop crashed")
            self._fatal_error = error
            self._end_all(f"the generation loop crashed: {type(error).__name__}: {error}")
        finally:
            self.output_router.wake_all()

    def _notice_weight_changes(self) -> None:
        """Before each step: if any parameter changed in place since the last step (an update inside `pause()`, an
        optimizer step between two sessions of a kept manager), K/V cached for the old weights must not be shared
        with new requests, so the prefix cache is invalidated. Reading ~one counter per parameter costs microseconds."""
        signature = hash(tuple((id(p), p._version) for p in self.model.parameters()))
        if self._weights_signature is not None and signature != self._weights_signature:
            dropped = self.cache.invalidate_prefixes()
            logger.info(f"cbcore: the model's weights changed; {dropped} cached prefix blocks will not be shared")
        self._weights_signature = signature

    def _park_while_paused(self) -> None:
        """Between two steps: while anyone holds the pause, stay parked (and say so)."""
        with self._pause_cond:
            if not self._pause_holders:
                return
            self._loop_parked = True
            self._pause_cond.notify_all()
            self._pause_cond.wait_for(lambda: self._pause_holders == 0)
            self._loop_parked = False

    def _take_new_requests(self) -> None:
        while True:
            try:
                state = self.input_queue.get_nowait()
            except queue.Empty:
                return
            problem = self._validate(state)
            if problem is not None:
                state.error = f"request {state.request_id}: {problem}"
                logger.warning(state.error)
                self._end(state, RequestStatus.FAILED, track=False)
                continue
            self._live_ids.add(state.request_id)
            self.scheduler.add(state)

    def _validate(self, state: RequestState) -> str | None:
        """What is wrong with a new request, or None. Checked before it touches the engine."""
        if state.request_id in self._live_ids:
            return "duplicate request id: a request with this id is still running; use a unique request_id"
        prompt = state.initial_tokens
        if not prompt:
            return "empty prompt: input_ids must hold at least one token"
        vocab = self.model.get_input_embeddings().num_embeddings
        bad = next((t for t in prompt if not isinstance(t, int) or t < 0 or t >= vocab), None)
        if bad is not None:
            return f"token id {bad!r} is outside the vocabulary [0, {vocab})"
        if state.max_new_tokens is not None and state.max_new_tokens < 1:
            return f"max_new_tokens must be >= 1, got {state.max_new_tokens}"
        kwargs_problem = self.runner.sampler.check_kwargs(state.logit_processor_kwargs)
        if kwargs_problem is not None:
            return kwargs_problem
        capacity = self.cache.capacity_tokens
        # The K/V of the last generated token is never needed, hence the - 1.
        longest = len(prompt) + (state.max_new_tokens - 1 if state.max_new_tokens is not None else 0)
        if longest > capacity:
            what = f"prompt has {len(prompt)} tokens"
            if state.max_new_tokens is not None:
                what += f" and may generate {state.max_new_tokens} more"
            return (
                f"{what}, but the cache holds at most {capacity} tokens per request (num_blocks="
                f"{self.cache.num_blocks} x page_size={self.cache.page_size}); raise num_blocks or shorten the "
                "prompt / max_new_tokens"
            )
        return None

    def _apply_cancellations(self) -> None:
        while True:
            try:
                request_id = self.cancel_queue.get_nowait()
            except queue.Empty:
                return
            state = next((s for s in self.scheduler.live_requests() if s.request_id == request_id), None)
            if state is not None:
                self._end(state, RequestStatus.CANCELLED)

    def _step(self) -> None:
        batch = self.scheduler.schedule()
        for state in batch.capped:
            # Unbounded generation reached the cache's capacity: end it like a length limit.
            self._end(state, RequestStatus.FINISHED)
        for state, reason in batch.failed:
            state.error = f"request {state.request_id}: {reason}"
            self._end(state, RequestStatus.FAILED)
        for child in batch.forked:
            self._live_ids.add(child.request_id)
        self.cache.flush_swaps()
        if not batch.requests:
            return
        started = time.perf_counter()
        try:
            result = self.runner.execute(batch)
        except Exception as error:  # noqa: BLE001 - a failing forward fails its batch, not the loop
            logger.exception("forward failed")
            for item in batch.requests:
                item.state.error = f"request {item.state.request_id}: forward failed: {type(error).__name__}: {error}"
                self._end(item.state, RequestStatus.FAILED)
            return
        if self.cache.swap is not None and any(item.num_tokens > 1 for item in batch.requests):
            self.cache.swap.policy.observe_prefill(batch.num_tokens, time.perf_counter() - started)
        self._account(batch)
        self.scheduler.on_step_done(batch)
        logprobs = result.logprobs or [None] * len(result.tokens)
        for item, token, logprob in zip(result.emitted, result.tokens, logprobs):
            state = item.state
            state.status = RequestStatus.DECODING
            self._counters["generated_tokens"] += 1
            if state.append_token(token, logprob):
                self._end(state, RequestStatus.FINISHED)
            elif state.streaming:
                self.output_router.deliver(state.to_generation_output())

    def _account(self, batch: ScheduledBatch) -> None:
        counters = self._counters
        counters["steps"] += 1
        for item in batch.requests:
            state = item.state
            start, end = state.num_computed_tokens, state.num_computed_tokens + item.num_tokens
            counters["computed_tokens"] += item.num_tokens
            counters["computed_prompt_tokens"] += max(0, min(end, len(state.initial_tokens)) - start)
            counters["recomputed_tokens"] += max(0, min(end, state.max_computed_tokens) - start)
            state.max_computed_tokens = max(state.max_computed_tokens, end)

    def _end(self, state: RequestState, status: RequestStatus, track: bool = True) -> None:
        """Give a request its one terminal output and release everything it holds."""
        if track:
            self.scheduler.finish(state)
            self._live_ids.discard(state.request_id)
        state.status = status
        self.output_router.deliver(state.to_generation_output())

    def _end_all(self, reason: str) -> None:
        """Fail every request still held (queued, waiting or running), keeping their partial tokens."""
        if self.scheduler is None:
            return
        pending = self.scheduler.live_requests()
        while True:
            try:
                pending.append(self.input_queue.get_nowait())
            except queue.Empty:
                break
        for state in pending:
            state.error = f"request {state.request_id}: {reason}"
            tracked = state.request_id in self._live_ids
            self._end(state, RequestStatus.FAILED, track=tracked)

    # ------------------------------------------------------------------------------------------ inspection ----

    def check_invariants(self) -> None:
        """Assert the allocator's invariants and that block refcounts equal the block tables holding them. Call it
        when the loop is stopped (the loop thread owns the engine state while it runs)."""
        if self.cache is not None:
            self.cache.check(self.scheduler.live_requests())

    def stats(self) -> dict[str, int | float]:
        """Counters to log, since the manager was built: steps; computed, prompt, recomputed and generated tokens;
        blocks free / cached (unused) / used; prefix-cache lookups, hits, hit rate and prompt tokens it saved;
        evictions; preemptions (swapped or recomputed); swaps out / in with bytes, host blocks free (for swap, counting
        the tier's), and the host tier's blocks kept, hits and drops (with `cpu_offload_space`); admissions deferred to
        share an in-flight prefix. Safe to call from any thread
        (a snapshot that may be one step stale while the loop runs)."""
        stats: dict[str, int | float] = dict(self._counters)
        if self.cache is not None:
            allocator = self.cache.allocator.stats()
            stats.update(
                num_blocks=self.cache.num_blocks,
                blocks_free=allocator["num_free"],
                blocks_cached=allocator["num_cached_unused"],
                blocks_used=allocator["num_referenced"],
                prefix_lookups=allocator["lookups"],
                prefix_hits=allocator["hits"],
                prefix_hit_rate=allocator["hits"] / allocator["lookups"] if allocator["lookups"] else 0.0,
                prefix_hit_tokens=self.scheduler.num_prefix_hit_tokens,
                evictions=allocator["evictions"],
                preemptions=self.scheduler.num_preemptions,
                swap_preemptions=self.scheduler.num_swap_preemptions,
                recompute_preemptions=self.scheduler.num_preemptions - self.scheduler.num_swap_preemptions,
                deferred_admissions=self.scheduler.num_deferred_admissions,
            )
            if self.cache.swap is not None:
                stats.update(self.cache.swap.counters)
                stats.update(self.cache.swap.tier.counters)
                stats.update(
                    host_blocks=self.cache.swap.num_host_blocks,
                    host_blocks_free=self.cache.swap.num_free,
                    host_tier_blocks=self.cache.swap.tier.num_blocks,
                )
        return stats

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens taken from the prefix cache instead of being computed."""
        return self.scheduler.num_prefix_hit_tokens if self.scheduler else 0

    @property
    def num_preemptions(self) -> int:
        """How many times a running request was preempted to make room."""
        return self.scheduler.num_preemptions if self.scheduler else 0
