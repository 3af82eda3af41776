"""`ContinuousBatchingManager`: the background loop, its queues, request validation and output routing.

One background thread owns all engine state (scheduler, cache, runner). Public methods may be called from any
thread; they only talk to the loop through queues, events and one lock. Each loop iteration: take in new requests
(validating each: a bad one fails alone), apply cancellations, ask the scheduler for a step, run it, advance the
requests and deliver outputs. Every request ends with exactly one terminal output: FINISHED, FAILED or CANCELLED.

Lifecycle, and who may touch the model when:

| phase | the model | `add_request` |
|---|---|---|
| built, not started | untouched | queues (served once started) |
| `start()` | attention switched and linears packed, all or nothing: a start that raises leaves the model as it was | queues |
| running | cbcore's attention inside its steps only; the model's own attention outside them | queues |
| `stop()` called | still cbcore's until the loop has ended | raises RuntimeError |
| the loop ended (stopped, or died) | handed back by the loop itself as it exits | raises RuntimeError (until `start()`) |
| `destroy()` | handed back | raises RuntimeError (for good) |

Mirrors transformers 5.24's `ContinuousBatchingManager` (same constructor, methods, argument names and defaults);
the differences are listed in the README and DESIGN.md §7.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.continuous_batching.utils import WorkloadHints

from . import request_inputs
from .cache import PagedKVCache
from .config import ContinuousBatchingConfig, as_cbcore_config
from .engine import EngineCore
from .model_support import check_model_supported, self_check, self_check_enabled
from .outputs import OutputRouter
from .requests import GenerationOutput, RequestState, RequestStatus, child_request_id
from .runner import ModelRunner
from .sampling import LogitsProcessorSwitch
from .scheduler import Scheduler

logger = logging.getLogger("cbcore")

# How long add_request waits for room in a full input queue (max_queue_size) before raising queue.Full, as transformers.
ADD_REQUEST_TIMEOUT_S = 10.0
# The generation modes cbcore implements; anything else (beam search, contrastive, assisted, DoLa) is refused rather
# than run greedily.
SUPPORTED_GENERATION_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


class _StopMode:
    RUNNING = 0
    FLUSH = 1  # finish everything queued, then stop
    HARD = 2  # fail whatever is pending, stop now


class BackgroundThreadStatus:
    """What transformers' own code reads of a manager's loop (its serving layer's `CBGenerateManager` checks
    `manager.background_thread_status.fatal_error` before each request): the error that killed the loop, or None."""

    def __init__(self) -> None:
        self.fatal_error: BaseException | None = None


class ContinuousBatchingManager:
    """Serves generation requests with continuous batching on a background thread.

    Create it directly or through `model.init_continuous_batching()` after `cbcore.enable(model)`:

        manager = ContinuousBatchingManager(model, GenerationConfig(max_new_tokens=32), ContinuousBatchingConfig())
        manager.start()
        request_id = manager.add_request([1, 2, 3])
        output = manager.get_result(request_id, timeout=10)
        manager.stop()

    The generation config is read as transformers reads it: its logits processors and generation mode here, once;
    `do_sample` when the engine is built (warmup or the first start); `max_new_tokens` and `eos_token_id` by each
    `add_request`.
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
        # The config exactly as `model.generate` prepares it (unset values from the model's generation config and
        # global defaults). Built now, as transformers builds its processors in its constructor.
        self._prepared_generation_config = self._prepare_generation_config()
        num_return_sequences = getattr(self.generation_config, "num_return_sequences", None)
        self.num_return_sequences = num_return_sequences if num_return_sequences is not None else 1
        if not isinstance(self.num_return_sequences, int) or self.num_return_sequences < 1:
            raise ValueError(f"num_return_sequences must be an int >= 1, got {self.num_return_sequences!r}")

        self.input_queue: queue.Queue[RequestState] = queue.Queue(
            maxsize=self.continuous_batching_config.max_queue_size
        )
        self.cancel_queue: queue.Queue[str] = queue.Queue()
        self.output_router = OutputRouter()
        self.background_thread_status = BackgroundThreadStatus()
        # The request lock guards what callers and the loop share: id assignment, the ids in flight, the requests
        # queued but not taken in yet (a cancel marks them there), and whether requests are accepted.
        self._request_lock = threading.Lock()
        self._request_counter = 0
        self._reserved_auto_numbers: set[int] = set()  # n of caller-chosen ids "req_<n>" the counter has not passed
        self._in_flight: set[str] = set()  # ids (children included) added and without a terminal output yet
        self._queued: dict[str, RequestState] = {}
        self._closed_reason: str | None = None  # why add_request is refused now; None: accepted
        self._destroyed = False
        self._wake_up_loop = threading.Event()
        self._stop_mode = _StopMode.RUNNING
        self._generation_thread: threading.Thread | None = None
        # Pause: callers hold it (a count, several at once); the loop parks at a step boundary while it is held.
        self._pause_cond = threading.Condition()
        self._pause_holders = 0
        self._loop_parked = False
        self._pause_owner = threading.local()

        # The engine (cache, scheduler, runner), built on first use (warmup or start) and stepped by the loop thread.
        self.engine: EngineCore | None = None
        self._engine_needs_rebuild = False  # after the loop died mid-step, its state cannot be trusted
        self._steps_at_start = 0  # the engine's step count when the loop last started (current_batch)
        self.warmed_up = False

        # The model is bound to cbcore's attention (engine.binding) by start() and handed back when the loop ends: a
        # manager that is built but never started leaves the model untouched (transformers switches it in __init__).
        self._use_prefix_sharing = self.continuous_batching_config.allow_block_sharing

    # ------------------------------------------------------------------------------------------------ set-up ----

    def _prepare_generation_config(self) -> GenerationConfig:
        """The generation config as `model.generate` prepares it, refusing what cbcore does not implement."""
        try:
            # Not `prepared.validate()`: it refuses greedy num_return_sequences > 1, which transformers' continuous
            # batching serves (identical children), and so does cbcore.
            prepared, _ = self.model._prepare_generation_config(self.generation_config)
            # Special tokens as tensors (min_new_tokens needs them), then the processors once, as `model.generate`
            # builds them: a value they refuse (a negative temperature, ...) is refused here, not at the first step.
            self.model._prepare_special_tokens(prepared, kwargs_has_attention_mask=True, device=self.model.device)
            processors = self.model._get_logits_processor(prepared, input_ids_seq_length=1, device=self.model.device)
        except (ValueError, TypeError) as error:
            raise ValueError(f"invalid GenerationConfig: {error}") from error
        self.logit_processor = LogitsProcessorSwitch(processors)
        mode = prepared.get_generation_mode()
        if mode not in SUPPORTED_GENERATION_MODES:
            raise NotImplementedError(
                f"generation mode {mode.value!r} (num_beams={prepared.num_beams}, penalty_alpha={prepared.penalty_alpha}, "
                "assistant / prompt lookup, dola_layers ...) is not supported by cbcore; it serves greedy decoding and "
                "sampling only, so it refuses rather than run greedy"
            )
        return prepared

    def switch_to_cb_friendly_attn(self, model: torch.nn.Module, auto_switch_to_flash: bool = True) -> None:
        """Point the model's attention at cbcore's paged attention (handed back when the loop ends), building the
        engine first if needed. cbcore always uses its own paged kernels, so `auto_switch_to_flash` has no effect.
        Idempotent. Called by `start()`."""
        if model is not self.model:
            raise ValueError("switch_to_cb_friendly_attn: this manager serves another model")
        if self.engine is None or self._engine_needs_rebuild:
            self._build_engine()
        self.engine.binding.attach()

    @property
    def _original_attn_impl(self) -> str | None:
        """The model's own attention implementation while cbcore's is attached, else None."""
        return self.engine.binding.original_attn_implementation if self.engine is not None else None

    @property
    def default_eos_token_id(self) -> int | list[int]:
        """EOS for requests that give none, read when each request is added (as transformers reads
        `manager.generation_config.eos_token_id` then) and resolved as `model.generate` resolves it: the manager's
        generation config, else `model.generation_config`; -1 (none) when neither sets one. The model config is not
        consulted, so `model.generation_config.eos_token_id = None` means "no EOS" here as it does for `generate`.
        (transformers' manager instead writes -1 into the caller's config, so its requests ignore the model's EOS.)"""
        eos = self.generation_config.eos_token_id
        if eos is None:
            eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        return -1 if eos is None else eos

    def _attach_to_model(self) -> None:
        """What `start()` does to the model: cbcore's attention, and on CPU the packed linear layers."""
        self.switch_to_cb_friendly_attn(self.model)

    def _restore_attn(self) -> None:
        """Hand the model back: its own attention implementation and linear layers. Idempotent; called by the loop
        as it ends (never while it may still step), by a failed `start()`, and by `destroy()`."""
        if self.engine is not None:
            self.engine.binding.detach()

    def _build_engine(self) -> None:
        """Build the engine (all or nothing: on an error nothing is kept)."""
        self.engine = None
        self.engine = EngineCore(
            self.model, self._prepared_generation_config, self.continuous_batching_config, self.workload_hints,
            self.logit_processor,
            do_sample=bool(self.generation_config.do_sample),  # read now, as transformers does
        )
        self._engine_needs_rebuild = False

    @property
    def cache(self) -> PagedKVCache | None:
        """The engine's paged KV cache (None until the engine is built)."""
        return self.engine.cache if self.engine is not None else None

    @property
    def scheduler(self) -> Scheduler | None:
        """The engine's scheduler (None until the engine is built)."""
        return self.engine.scheduler if self.engine is not None else None

    @property
    def runner(self) -> ModelRunner | None:
        """The engine's model runner (None until the engine is built)."""
        return self.engine.runner if self.engine is not None else None

    def warmup(self) -> None:
        """Build the engine (cache, scheduler, runner) ahead of the first request. cbcore has no CUDA graphs to
        capture yet, so this is all warmup does."""
        self._refuse_if_destroyed("warmup")
        check_model_supported(self.model)  # a model cbcore cannot serve exactly is refused before anything is built
        if self.engine is None or self._engine_needs_rebuild:
            self._build_engine()
        self.warmed_up = True

    # ------------------------------------------------------------------------------------------- lifecycle ----

    def is_running(self) -> bool:
        """Whether the background thread has been started and is still alive."""
        return self._generation_thread is not None and self._generation_thread.is_alive()

    def _refuse_if_destroyed(self, what: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"cannot {what}: this manager was destroyed; build a new one")

    def start(self) -> None:
        """Start the background generation thread, building the engine first if needed. All or nothing: if building
        the engine or preparing the model raises, the model is left exactly as it was. A manager whose loop died
        starts again on a freshly built engine (its `background_thread_status.fatal_error` is cleared)."""
        self._refuse_if_destroyed("start")
        if self.is_running():
            logger.warning("Manager thread is already running.")
            return
        try:
            check_model_supported(self.model)  # before the model is touched or the engine built
            if self.engine is None or self._engine_needs_rebuild:
                self._build_engine()
            self._attach_to_model()
            if self_check_enabled():  # cbcore's paged path against the model's own forward, before any request
                self_check(self.model, self._original_attn_impl)
        except BaseException:
            self._restore_attn()
            raise
        with self._request_lock:
            self._closed_reason = None
            self._stop_mode = _StopMode.RUNNING
        self.background_thread_status.fatal_error = None
        with self._pause_cond:
            self._loop_parked = False
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
        is pending (with its partial tokens). From this call on, `add_request` raises. `block` waits up to `timeout`
        seconds for the thread to end. `keep_for_next_session` caches the manager on the model for the next
        `init_continuous_batching`.

        The model gets its own attention and linear layers back when the loop has ended, from the loop itself: with
        `block=True` and no timeout, before this returns; with `block=False` (or a timeout that expires first), later,
        while the loop finishes what it serves (the requests in flight keep cbcore's attention to the end, so their
        tokens stay exact). `join()` waits for that moment."""
        if self._generation_thread is None:
            logger.warning("Manager not started.")
            return
        if getattr(self._pause_owner, "depth", 0):
            raise RuntimeError(
                "Cannot stop the manager from inside a pause: the loop is paused and cannot exit, so this would wait "
                "forever. Leave the `pause` context before calling `stop`."
            )
        stop_trigger_time = time.perf_counter()
        with self._request_lock:
            if self._closed_reason is None:
                self._closed_reason = "the manager is stopping (stop() was called); call start() to serve again"
            # The mode only ever moves towards HARD: a flush stop after a hard one does not undo it.
            self._stop_mode = max(self._stop_mode, _StopMode.HARD if hard_stop else _StopMode.FLUSH)
        self._wake_up_loop.set()
        if block:
            self.join(stop_trigger_time, timeout)
        if keep_for_next_session:
            self.model._cached_continuous_batching_manager = self

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        """Wait (up to `timeout` seconds) for the background thread to finish; once it has, the model is handed
        back."""
        thread = self._generation_thread
        if thread is None:
            return
        thread.join(timeout=timeout)
        if thread.is_alive():
            logger.warning(f"Generation thread did not exit after join timeout ({timeout}).")
        else:
            if stop_trigger_time is not None:
                logger.info(f"Background generation thread stopped after {time.perf_counter() - stop_trigger_time:.2f}s.")
            self._generation_thread = None

    def destroy(self) -> None:
        """Stop if running (waiting for the loop to end), hand the model back and release the cache. Safe to call
        several times. The manager cannot be used after: `start`, `warmup`, `add_request` and `pause` raise."""
        if self.is_running() and self._stop_mode == _StopMode.RUNNING:
            self.stop(block=True)
        with self._request_lock:
            self._destroyed = True
            self._closed_reason = "this manager was destroyed; build a new one"
        if self.is_running():
            # stop(block=False) (or a timeout) left the loop finishing its requests: it hands back the model and
            # releases the engine itself when it ends, so destroying does not wait for it.
            return
        self._release()

    def _release(self) -> None:
        self._restore_attn()
        self.engine = None

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Pause the loop for the `with` block, e.g. to update the model's weights in place. The block is entered once
        the loop is parked between two steps; on exit it resumes with its cache and in-flight requests intact
        (nothing is drained, nothing lost). Several threads may hold the pause at once; the loop resumes when the last
        one leaves. Raises RuntimeError when no loop is running, or when the loop ends (stopped or crashed) before it
        could park: it never waits for a loop that is gone."""
        self._refuse_if_destroyed("pause")
        if not self.is_running():
            raise RuntimeError("Cannot pause generation while no generation loop is running.")
        thread = self._generation_thread
        with self._pause_cond:
            self._pause_holders += 1
        try:
            self._wake_up_loop.set()
            with self._pause_cond:
                # Poll the thread too: a loop that dies between two notifications would otherwise be waited on forever.
                while not self._loop_parked:
                    if thread is None or not thread.is_alive():
                        raise RuntimeError(
                            "The generation loop stopped before it could pause."
                        ) from self.background_thread_status.fatal_error
                    self._pause_cond.wait(timeout=0.05)
            self._pause_owner.depth = getattr(self._pause_owner, "depth", 0) + 1
            try:
                yield
            finally:
                self._pause_owner.depth -= 1
        finally:
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
        """Queue a request; returns its id (`req_<n>` unless given; automatic ids skip ids in use).

        Raised here, before anything is queued, naming the argument: a wrong type (`TypeError`: token ids that are
        not ints, `max_new_tokens="5"` or `2.5`, a non-str `request_id`), a value out of range (`ValueError`:
        `max_new_tokens < 1`, a per-request temperature of 0), an id that is still in flight (`ValueError`: two live
        requests with one id would be indistinguishable to anyone routing outputs by id), and a manager that does not
        accept requests (`RuntimeError`: stopping, stopped, crashed or destroyed). Token ids may be a list of ints, or
        a 1-D integer tensor or numpy array.

        Problems of the prompt itself (empty, ids outside the vocabulary, longer than the cache or the model's
        position table) end this request alone with a FAILED output naming it, so one bad prompt of a batch does not
        stop the others. Raises `queue.Full` when `max_queue_size` is reached and no slot frees up within 10 s (as
        transformers does)."""
        request_id = request_inputs.request_id(request_id)
        label = f"request {request_id}" if request_id is not None else "add_request"
        state = self._new_state(
            request_inputs.token_ids(input_ids, f"{label}: input_ids"),
            request_id,
            request_inputs.max_new_tokens(max_new_tokens, f"{label}: max_new_tokens"),
            bool(streaming),
            bool(record_timestamps),
            request_inputs.eos_token_id(eos_token_id, f"{label}: eos_token_id"),
            self._checked_processor_kwargs(logit_processor_kwargs, label),
        )
        self._register(state, reserved=False)
        self._enqueue(state)
        return state.request_id

    def add_requests(
        self,
        inputs: list[list[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        **logit_processor_kwargs: Any,
    ) -> list[str]:
        """Queue several requests; returns their ids in input order. Every argument is checked before any request is
        queued (errors name the prompt's index); `inputs` may be a list of prompts or a 2-D integer tensor / array.
        With prefix sharing, they are queued sorted by content (as transformers does) so that requests sharing a
        prefix run one after another."""
        prompts = request_inputs.batch_of_token_ids(inputs)
        max_new_tokens = request_inputs.max_new_tokens(max_new_tokens, "add_requests: max_new_tokens")
        kwargs = self._checked_processor_kwargs(logit_processor_kwargs, "add_requests")
        eos = self.default_eos_token_id
        states = [
            self._new_state(prompt, None, max_new_tokens, bool(streaming), bool(record_timestamps), eos, kwargs)
            for prompt in prompts
        ]
        with self._request_lock:
            self._check_accepting()
            for state in states:
                self._register(state, reserved=True)
        request_ids = [state.request_id for state in states]
        ordered = sorted(states, key=lambda s: s.initial_tokens, reverse=True) if self._use_prefix_sharing else states
        for index, state in enumerate(ordered):
            try:
                self._enqueue(state)
            except BaseException:
                with self._request_lock:
                    for unqueued in ordered[index + 1 :]:
                        self._unregister(unqueued)
                raise
        return request_ids

    def _checked_processor_kwargs(self, kwargs: dict[str, Any], label: str) -> dict[str, Any]:
        return request_inputs.processor_kwargs(
            kwargs,
            self.continuous_batching_config.per_request_processors,
            # The processors, per-request ones included, exist when the config sampled at construction (as in
            # transformers, whose per-request keys come from the processors built in its constructor).
            bool(self._prepared_generation_config.do_sample),
            label,
        )

    def _new_state(
        self,
        prompt: list[int],
        request_id: str | None,
        max_new_tokens: int | None,
        streaming: bool,
        record_timestamps: bool,
        eos_token_id: int | list[int] | None,
        kwargs: dict[str, Any],
    ) -> RequestState:
        """A request not yet queued; an automatic id is given when it is registered."""
        if max_new_tokens is None:
            max_new_tokens = self.generation_config.max_new_tokens
        return RequestState(
            request_id=request_id or "",
            initial_tokens=prompt,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.default_eos_token_id if eos_token_id is None else eos_token_id,
            streaming=streaming,
            record_timestamps=record_timestamps,
            num_children=self.num_return_sequences - 1,
            logit_processor_kwargs=kwargs,
        )

    def _check_accepting(self) -> None:
        """Under the request lock: raise when requests are not accepted now."""
        if self._closed_reason is not None:
            fatal = self.background_thread_status.fatal_error
            raise RuntimeError(f"cannot add a request: {self._closed_reason}") from fatal

    def _register(self, state: RequestState, reserved: bool) -> None:
        """Give `state` its id (an automatic one when it has none) and mark its family in flight. `reserved`: the
        caller holds the request lock and has checked that requests are accepted."""
        if not reserved:
            with self._request_lock:
                self._check_accepting()
                self._register(state, reserved=True)
            return
        if not state.request_id:
            while True:
                number = self._request_counter
                self._request_counter += 1
                self._reserved_auto_numbers.discard(number)
                candidate = f"req_{number}"
                if number not in self._reserved_auto_numbers and not self._family_in_flight(candidate, state):
                    state.request_id = candidate
                    break
        elif self._family_in_flight(state.request_id, state):
            raise ValueError(
                f"request {state.request_id}: duplicate request id: a request with this id is still in flight; wait "
                "for its terminal output or use another request_id"
            )
        else:
            number = _auto_number(state.request_id)
            if number is not None and number >= self._request_counter:
                self._reserved_auto_numbers.add(number)
        self._in_flight.update(_family_ids(state.request_id, state.num_children))

    def _family_in_flight(self, request_id: str, state: RequestState) -> bool:
        return any(rid in self._in_flight for rid in _family_ids(request_id, state.num_children))

    def _unregister(self, state: RequestState) -> None:
        """Under the request lock: `state` was never queued after all."""
        self._in_flight.difference_update(_family_ids(state.request_id, state.num_children))

    def _enqueue(self, state: RequestState) -> None:
        """Put a registered request on the input queue, waiting (bounded) for room. Checked under the same lock as
        `stop()` closes the manager, so a request is either queued before stopping began (and served) or refused."""
        deadline = time.monotonic() + ADD_REQUEST_TIMEOUT_S
        while True:
            with self._request_lock:
                try:
                    self._check_accepting()
                    self.input_queue.put_nowait(state)
                except queue.Full:
                    pass
                except BaseException:
                    self._unregister(state)
                    raise
                else:
                    self._queued[state.request_id] = state
                    self._wake_up_loop.set()
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                with self._request_lock:
                    self._unregister(state)
                raise queue.Full(f"request {state.request_id}: the input queue is full (max_queue_size)")
            with self.input_queue.not_full:
                self.input_queue.not_full.wait(timeout=min(remaining, 0.05))

    def cancel_request(self, request_id: str) -> None:
        """Cancel a request, whether it is queued, waiting or running (a child `req_<n>__child#<i>` too, before or
        after its fork): its blocks are freed and it ends with one CANCELLED output (transformers sends none).
        Cancelling an id that already ended, or never existed, does nothing."""
        with self._request_lock:
            queued = self._queued.get(request_id)
            if queued is not None:  # not taken in by the loop yet: it reads this mark when it takes it in
                queued.cancel_requested = True
        if queued is None:
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
        engine = self.engine
        self._steps_at_start = engine.counters["steps"]
        try:
            with torch.inference_mode(use_inference_mode):
                engine.notice_weight_changes()  # since the last session of a kept manager
                while True:
                    if self._park_while_paused():
                        engine.notice_weight_changes()  # weights change only inside a pause (or between sessions)
                    self._take_new_requests()
                    self._apply_cancellations()
                    if self._stop_mode == _StopMode.HARD:
                        self._end_all("the manager was stopped with hard_stop=True before this request finished")
                        break
                    if not engine.has_work():
                        # add_request is refused once stop() began (same lock), so an empty queue stays empty.
                        if self._stop_mode == _StopMode.FLUSH and self.input_queue.empty():
                            break
                        self._wake_up_loop.wait(timeout=0.1)
                        self._wake_up_loop.clear()
                        continue
                    self._deliver(engine.step())
        except BaseException as error:  # noqa: BLE001 - the loop must report, not vanish
            logger.exception("cbcore generation loop crashed")
            with self._request_lock:
                self.background_thread_status.fatal_error = error
                self._closed_reason = f"the generation loop died ({type(error).__name__}: {error}); call start() again"
            self._engine_needs_rebuild = True
            try:
                self._end_all(f"the generation loop crashed: {type(error).__name__}: {error}")
            except BaseException:  # noqa: BLE001 - still hand the model back and wake every waiter below
                logger.exception("cbcore: failing the pending requests after a crash failed")
        finally:
            # Only now, with no step in flight, may the model be handed back (stop(block=False) returns earlier).
            self._restore_attn()
            if self._destroyed:  # destroyed while it finished (after stop(block=False))
                self._release()
            with self._pause_cond:
                self._pause_cond.notify_all()
            self.output_router.wake_all()

    def _park_while_paused(self) -> bool:
        """Between two steps: while anyone holds the pause, stay parked (and say so). Whether it parked."""
        with self._pause_cond:
            if not self._pause_holders:
                return False
            self._loop_parked = True
            self._pause_cond.notify_all()
            self._pause_cond.wait_for(lambda: self._pause_holders == 0)
            self._loop_parked = False
            return True

    def _take_new_requests(self) -> None:
        while True:
            try:
                state = self.input_queue.get_nowait()
            except queue.Empty:
                return
            with self._request_lock:
                self._queued.pop(state.request_id, None)
                cancelled = state.cancel_requested
            if cancelled:
                self._deliver(self.engine.end_unadmitted(state, RequestStatus.CANCELLED))
            else:
                self._deliver(self.engine.add_request(state))

    def _apply_cancellations(self) -> None:
        while True:
            try:
                request_id = self.cancel_queue.get_nowait()
            except queue.Empty:
                return
            self._deliver(self.engine.abort(request_id))

    def _end_all(self, reason: str) -> None:
        """Fail every request still held (queued here, waiting or running), keeping their partial tokens."""
        queued = []
        while True:
            try:
                state = self.input_queue.get_nowait()
            except queue.Empty:
                break
            with self._request_lock:
                self._queued.pop(state.request_id, None)
            queued.append(state)
        if self.engine is not None:
            self._deliver(self.engine.fail_all(reason, queued))

    def _deliver(self, outputs: list[GenerationOutput]) -> None:
        """Hand the engine's outputs to the router; a terminal output frees its id from this moment."""
        for output in outputs:
            if output.is_finished():
                with self._request_lock:
                    self._in_flight.discard(output.request_id)
            self.output_router.deliver(output)

    # ------------------------------------------------------------------------------------------ inspection ----

    def check_invariants(self) -> None:
        """Assert the allocator's invariants and that block refcounts equal the block tables holding them. Call it
        when the loop is stopped (the loop thread owns the engine state while it runs)."""
        if self.engine is not None:
            self.engine.check()

    def stats(self) -> dict[str, int | float]:
        """Counters to log, since the engine was built: steps; computed, prompt, recomputed and generated tokens;
        blocks free / cached (unused) / used; prefix-cache lookups, hits, hit rate and prompt tokens it saved;
        evictions; preemptions (swapped or recomputed); swaps out / in with bytes, host blocks free (for swap, counting
        the tier's), and the host tier's blocks kept, hits and drops (with `cpu_offload_space`); admissions deferred to
        share an in-flight prefix. Safe to call from any thread (a snapshot that may be one step stale while the loop
        runs); empty before the engine is built."""
        return self.engine.stats() if self.engine is not None else {}

    @property
    def current_batch(self) -> int:
        """Steps (forwards) run since the loop last started, as transformers' attribute of that name counts them."""
        return self.engine.counters["steps"] - self._steps_at_start if self.engine is not None else 0

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens taken from the prefix cache instead of being computed."""
        return self.scheduler.num_prefix_hit_tokens if self.scheduler else 0

    @property
    def num_preemptions(self) -> int:
        """How many times a running request was preempted to make room."""
        return self.scheduler.num_preemptions if self.scheduler else 0


def _family_ids(request_id: str, num_children: int) -> list[str]:
    """A request's id and those of its `num_return_sequences - 1` children."""
    return [request_id] + [child_request_id(request_id, index) for index in range(num_children)]


def _auto_number(request_id: str) -> int | None:
    """n for an id of the automatic form "req_<n>", else None."""
    prefix, _, number = request_id.partition("req_")
    return int(number) if not prefix and number.isdigit() else None
