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
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.continuous_batching.utils import WorkloadHints

from . import attention, request_inputs
from .cache import CacheShape, PagedKVCache, plan_num_blocks, useful_blocks
from .config import ContinuousBatchingConfig, as_cbcore_config
from .linear import PackedLinears
from .model_support import check_model_supported, self_check, self_check_enabled
from .outputs import OutputRouter
from .requests import GenerationOutput, RequestState, RequestStatus, child_request_id
from .runner import ModelRunner
from .sampling import LogitsProcessorSwitch, Sampler
from .scheduler import SCHEDULING_ORDERS, ScheduledBatch, ScheduledRequest, Scheduler
from .swap import plan_num_host_blocks

logger = logging.getLogger("cbcore")

# Default step budgets when the config leaves them None (transformers infers them from GPU memory).
DEFAULT_MAX_BATCH_TOKENS = {"cpu": 1024, "cuda": 8192}
FALLBACK_MAX_REQUESTS_PER_BATCH = 1024  # transformers' fallback
CPU_MAX_MEMORY_PERCENT = 0.6  # transformers' default on CPU; cbcore also caps the bytes (cache.CPU_CACHE_CAP_BYTES)
# How long add_request waits for room in a full input queue (max_queue_size) before raising queue.Full, as transformers.
ADD_REQUEST_TIMEOUT_S = 10.0
# An explicit num_blocks may take at most this share of the memory available when the cache is allocated: beyond it
# the allocation would push the machine into swap or fail with a raw allocator error.
MAX_EXPLICIT_CACHE_SHARE = 0.9
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

    The generation config is read once, here, as transformers does: its logits processors, generation mode and EOS
    are fixed for the manager's life (`manager.generation_config.max_new_tokens` is still read by each `add_request`).
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
        self.default_eos_token_id = self._resolve_default_eos()
        num_return_sequences = getattr(self.generation_config, "num_return_sequences", None)
        self.num_return_sequences = num_return_sequences if num_return_sequences is not None else 1
        if not isinstance(self.num_return_sequences, int) or self.num_return_sequences < 1:
            raise ValueError(f"num_return_sequences must be an int >= 1, got {self.num_return_sequences!r}")
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self._position_limit = _absolute_position_limit(model)

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

        # Engine state, built on first use (warmup or start) and owned by the loop thread afterwards.
        self.cache: PagedKVCache | None = None
        self.scheduler: Scheduler | None = None
        self.runner: ModelRunner | None = None
        self._engine_needs_rebuild = False  # after the loop died mid-step, its state cannot be trusted
        self.warmed_up = False
        self._counters = {
            "steps": 0,
            "computed_tokens": 0,
            "computed_prompt_tokens": 0,
            "recomputed_tokens": 0,
            "generated_tokens": 0,
        }

        # The model's attention is switched by start() and handed back when the loop ends: a manager that is built
        # but never started leaves the model untouched (transformers switches it in __init__).
        self._model_lock = threading.Lock()
        self._original_attn_impl: str | None = None
        # On CPU, start() also runs the model's linear layers on prepacked oneDNN weights during cbcore's steps
        # (cbcore/linear.py); the end of the loop gives them back.
        self._packed_linears: PackedLinears | None = None
        # The parameters' in-place version counters when the loop last looked (see _notice_weight_changes).
        self._weights_signature: int | None = None
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
        """Point the model's attention at cbcore's paged attention (handed back when the loop ends). cbcore always
        uses its own paged kernels, so `auto_switch_to_flash` has no effect. Idempotent. Called by `start()`."""
        name = attention.register()
        current = model.config._attn_implementation
        if current != name and self._original_attn_impl is None:
            model.set_attn_implementation(name)
            self._original_attn_impl = current

    def _resolve_default_eos(self) -> int | list[int]:
        """EOS for requests that give none, exactly as `model.generate` resolves it: the given generation config
        merged with `model.generation_config`; -1 (none) when neither sets one. The model config is not consulted,
        so `model.generation_config.eos_token_id = None` means "no EOS" here as it does for `generate`.
        (transformers' manager instead writes -1 into the caller's config, so its requests ignore the model's EOS.)"""
        eos = self._prepared_generation_config.eos_token_id
        return -1 if eos is None else eos

    def _attach_to_model(self) -> None:
        """What `start()` does to the model: cbcore's attention, and on CPU the packed linear layers."""
        with self._model_lock:
            self.switch_to_cb_friendly_attn(self.model)
            if self._packed_linears is None and self.model.device.type == "cpu":
                self._packed_linears = PackedLinears.attach(self.model)

    def _restore_attn(self) -> None:
        """Hand the model back: its own attention implementation and linear layers. Idempotent; called by the loop
        as it ends (never while it may still step), by a failed `start()`, and by `destroy()`."""
        with self._model_lock:
            if self._packed_linears is not None:
                self._packed_linears.detach()
                self._packed_linears = None
            if self._original_attn_impl is not None:
                self.model.set_attn_implementation(self._original_attn_impl)
                self._original_attn_impl = None

    def _build_engine(self) -> None:
        """Size and allocate the cache, and build the scheduler, sampler and runner. All or nothing: on an error
        nothing is kept."""
        self.cache = self.scheduler = self.runner = None
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
        else:
            _check_cache_fits(shape, num_blocks, cfg.page_size, device)
        try:
            cache = PagedKVCache(shape, num_blocks, cfg.page_size, device, cfg.allow_block_sharing)
        except (RuntimeError, MemoryError) as error:  # torch raises RuntimeError when an allocation fails
            raise ValueError(
                f"could not allocate the KV cache (num_blocks={num_blocks} x page_size={cfg.page_size}, "
                f"{_gib(num_blocks * cfg.page_size * shape.bytes_per_token)} GiB): {error}; lower num_blocks"
            ) from error
        if cfg.cpu_offload_space is None or cfg.cpu_offload_space > 0:
            bytes_per_block = shape.bytes_per_token * cfg.page_size
            num_host_blocks = plan_num_host_blocks(
                cfg.cpu_offload_space, cfg.cpu_offload_space_safety_threshold, bytes_per_block
            )
            if num_host_blocks < 1:
                raise ValueError(
                    f"cpu_offload_space={cfg.cpu_offload_space} GiB holds no block of {bytes_per_block} bytes "
                    f"(after the cpu_offload_space_safety_threshold cap and what memory is available); raise it or "
                    "set it to 0 to disable swap"
                )
            cache.enable_swap(num_host_blocks)
            logger.info(
                f"cbcore: host pool of {num_host_blocks} blocks ({_gib(num_host_blocks * bytes_per_block)} GiB) for "
                f"cpu_offload_space={cfg.cpu_offload_space}"
            )
        max_requests = min(max_requests, max_batch_tokens)
        scheduler = Scheduler(
            cache,
            SCHEDULING_ORDERS[cfg.scheduler_type](),
            max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_requests,
            safety_margin=cfg.safety_margin,
        )
        generation_config = self._prepared_generation_config

        def processors_for(prompt_length: int, max_new_tokens: int | None, overrides: dict):
            # As `model.generate` prepares a call: max_length counts from this prompt, so length-dependent
            # processors (forced EOS at max_length - 1, ...) fire where they would for this request alone.
            config = copy.deepcopy(generation_config)
            if max_new_tokens is not None:
                config.max_length = prompt_length + max_new_tokens
            for name, value in overrides.items():
                setattr(config, name, value)
            return self.model._get_logits_processor(config, input_ids_seq_length=prompt_length, device=device)

        sampler = Sampler(
            generation_config, processors_for, cfg.return_logprobs, cfg.seed, cfg.per_request_processors,
            self.logit_processor,
        )
        self.cache, self.scheduler = cache, scheduler
        self.runner = ModelRunner(self.model, cache, sampler)
        self._engine_needs_rebuild = False
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
        self._refuse_if_destroyed("warmup")
        check_model_supported(self.model)  # a model cbcore cannot serve exactly is refused before anything is built
        if self.cache is None or self._engine_needs_rebuild:
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
            if self.cache is None or self._engine_needs_rebuild:
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
        self.cache = self.scheduler = self.runner = None

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
                        # add_request is refused once stop() began (same lock), so an empty queue stays empty.
                        if self._stop_mode == _StopMode.FLUSH and self.input_queue.empty():
                            break
                        self._wake_up_loop.wait(timeout=0.1)
                        self._wake_up_loop.clear()
                        continue
                    self._notice_weight_changes()
                    self._step()
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
            with self._request_lock:
                self._queued.pop(state.request_id, None)
                cancelled = state.cancel_requested
            if cancelled:
                self._end(state, RequestStatus.CANCELLED, track=False)
                continue
            problem = self._validate(state)
            if problem is not None:
                state.error = f"request {state.request_id}: {problem}"
                logger.warning(state.error)
                self._end(state, RequestStatus.FAILED, track=False)
                continue
            self.scheduler.add(state)

    def _validate(self, state: RequestState) -> str | None:
        """What is wrong with the prompt of a new request, or None. Checked before it touches the engine; the
        arguments' types were checked by `add_request`, so nothing here can raise."""
        prompt = state.initial_tokens
        if not prompt:
            return "empty prompt: input_ids must hold at least one token"
        vocab = self._vocab_size
        bad = next((t for t in prompt if t < 0 or t >= vocab), None)
        if bad is not None:
            return f"token id {bad} is outside the vocabulary [0, {vocab})"
        capacity = self.cache.capacity_tokens
        if len(prompt) > capacity:
            return (
                f"prompt has {len(prompt)} tokens, but the cache holds at most {capacity} tokens per request "
                f"(num_blocks={self.cache.num_blocks} x page_size={self.cache.page_size}); raise num_blocks or "
                "shorten the prompt"
            )
        # A longer max_new_tokens is accepted, as transformers accepts it: the request ends FINISHED when it alone
        # fills the cache (scheduler: capped).
        limit = self._position_limit
        if limit is not None:
            # Positions 0 .. len(prompt) + max_new_tokens - 2 are fed (the last token is never fed back).
            longest = len(prompt) + (state.max_new_tokens - 1 if state.max_new_tokens is not None else 0)
            if longest > limit:
                return (
                    f"prompt has {len(prompt)} tokens and may generate {state.max_new_tokens} more, but "
                    f"{type(self.model).__name__} has {limit} positions; shorten the prompt or lower max_new_tokens"
                )
            if state.max_new_tokens is None:  # unbounded: end at the end of the position table
                state.new_tokens_limit = min(state.new_tokens_limit, limit - len(prompt) + 1)
        return None

    def _apply_cancellations(self) -> None:
        while True:
            try:
                request_id = self.cancel_queue.get_nowait()
            except queue.Empty:
                return
            live = self.scheduler.live_requests()
            state = next((s for s in live if s.request_id == request_id), None)
            if state is not None:
                self._end(state, RequestStatus.CANCELLED)
                continue
            # A child not forked yet: it ends now, and its parent will not fork it.
            parent_id, index = _split_child_id(request_id)
            parent = next((s for s in live if s.request_id == parent_id), None) if parent_id is not None else None
            if parent is not None and index < parent.num_children and index not in parent.cancelled_children:
                parent.cancelled_children.add(index)
                child = parent.fork_child(request_id)
                child.status = RequestStatus.CANCELLED
                self._deliver_terminal(child)

    def _step(self) -> None:
        batch = self.scheduler.schedule()
        for state in batch.capped:
            # Generation reached the cache's capacity with this request alone in it: end it like a length limit.
            self._end(state, RequestStatus.FINISHED)
        for state, reason in batch.failed:
            state.error = f"request {state.request_id}: {reason}"
            self._end(state, RequestStatus.FAILED)
        self.cache.flush_swaps()
        if not batch.requests:
            return
        started = time.perf_counter()
        results, failures = self._execute_isolating_failures(batch.requests)
        for item, error in failures:
            item.state.error = f"request {item.state.request_id}: this step failed: {type(error).__name__}: {error}"
            self._end(item.state, RequestStatus.FAILED)
        if not failures and self.cache.swap is not None and any(item.num_tokens > 1 for item in batch.requests):
            self.cache.swap.policy.observe_prefill(batch.num_tokens, time.perf_counter() - started)
        failed = {id(item) for item, _ in failures}
        succeeded = [item for item in batch.requests if id(item) not in failed]
        if not succeeded:
            return
        done = ScheduledBatch(requests=succeeded)
        self._account(done)
        self.scheduler.on_step_done(done)
        for result in results:
            logprobs = result.logprobs or [None] * len(result.tokens)
            for item, token, logprob in zip(result.emitted, result.tokens, logprobs):
                state = item.state
                state.status = RequestStatus.DECODING
                self._counters["generated_tokens"] += 1
                if state.append_token(token, logprob):
                    self._end(state, RequestStatus.FINISHED)
                elif state.streaming:
                    self.output_router.deliver(state.to_generation_output())

    def _execute_isolating_failures(self, items: list[ScheduledRequest]) -> tuple[list, list]:
        """Run the step; if its forward or sampling raises, find the request(s) responsible by running halves of the
        batch again (bisection), so only the culprit fails: a request whose processor raises, or whose position
        runs past the model's table, fails alone and the others of its step go on. Rerunning is exact: a request's
        K/V is rewritten with the same values into its own blocks. Returns (step results, [(item, error)])."""
        try:
            return [self.runner.execute(ScheduledBatch(requests=items))], []
        except Exception as error:  # noqa: BLE001 - a failing step fails its culprits, not the loop
            if len(items) == 1:
                logger.warning(f"cbcore: request {items[0].state.request_id} failed its step: {error!r}")
                return [], [(items[0], error)]
            logger.warning(f"cbcore: a step of {len(items)} requests failed ({error!r}); isolating the culprit")
        middle = len(items) // 2
        first_results, first_failures = self._execute_isolating_failures(items[:middle])
        second_results, second_failures = self._execute_isolating_failures(items[middle:])
        return first_results + second_results, first_failures + second_failures

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
        """Give a request its one terminal output and release everything it holds. Children it has not forked yet
        end with it, with its status and error (they would otherwise never get an output)."""
        if track:
            self.scheduler.finish(state)
        state.status = status
        for index in range(state.num_children):
            if index in state.cancelled_children:
                continue  # already ended CANCELLED
            child = state.fork_child(child_request_id(state.request_id, index))
            child.status = status
            if state.error is not None:
                child.error = f"request {child.request_id}: its parent {state.error}"
            self._deliver_terminal(child)
        state.num_children = 0
        self._deliver_terminal(state)

    def _deliver_terminal(self, state: RequestState) -> None:
        """Deliver a terminal output; its id is free again from this moment."""
        with self._request_lock:
            self._in_flight.discard(state.request_id)
        self.output_router.deliver(state.to_generation_output())

    def _end_all(self, reason: str) -> None:
        """Fail every request still held (queued, waiting or running), keeping their partial tokens."""
        pending = self.scheduler.live_requests() if self.scheduler is not None else []
        tracked = {id(state) for state in pending}
        while True:
            try:
                state = self.input_queue.get_nowait()
            except queue.Empty:
                break
            with self._request_lock:
                self._queued.pop(state.request_id, None)
            pending.append(state)
        for state in pending:
            state.error = f"request {state.request_id}: {reason}"
            self._end(state, RequestStatus.FAILED, track=id(state) in tracked)

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


def _family_ids(request_id: str, num_children: int) -> list[str]:
    """A request's id and those of its `num_return_sequences - 1` children."""
    return [request_id] + [child_request_id(request_id, index) for index in range(num_children)]


def _split_child_id(request_id: str) -> tuple[str | None, int]:
    """("req_3", 1) for "req_3__child#1"; (None, -1) for an id that is not a child's."""
    parent, sep, index = request_id.rpartition("__child#")
    if not sep or not index.isdigit():
        return None, -1
    return parent, int(index)


def _auto_number(request_id: str) -> int | None:
    """n for an id of the automatic form "req_<n>", else None."""
    prefix, _, number = request_id.partition("req_")
    return int(number) if not prefix and number.isdigit() else None


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f}"


def _check_cache_fits(shape: CacheShape, num_blocks: int, page_size: int, device: torch.device) -> None:
    """An explicit `num_blocks` x `page_size` must fit in the memory available now, with room to spare; say so
    before allocating rather than fail in the allocator (or push the machine into swap)."""
    needed = num_blocks * page_size * shape.bytes_per_token
    if device.type == "cuda":
        available, _total = torch.cuda.mem_get_info(device)
    else:
        available = psutil.virtual_memory().available
    if needed > MAX_EXPLICIT_CACHE_SHARE * available:
        raise ValueError(
            f"num_blocks={num_blocks} x page_size={page_size} needs {_gib(needed)} GiB of KV cache "
            f"({shape.bytes_per_token} bytes per token), but only {_gib(available)} GiB of {device.type} memory is "
            "available; lower num_blocks or page_size (or leave num_blocks=None to size it automatically)"
        )


def _absolute_position_limit(model: torch.nn.Module) -> int | None:
    """How many positions a model with a learned absolute position table takes (GPT-2's `wpe`, OPT's
    `embed_positions`), or None when positions are relative (RoPE, ALiBi): a request past it would index outside the
    table. Found by module name; a model this misses still fails alone (the step's culprit is isolated)."""
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Embedding) and (leaf == "wpe" or "position" in leaf):
            return module.num_embeddings - int(getattr(module, "offset", 0))
    return None
