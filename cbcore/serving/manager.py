"""`ContinuousBatchingManager`: construction, the engine it builds, start / stop / join / destroy.

One background thread owns all engine state (scheduler, cache, runner). Public methods may be called from any
thread; they only talk to the loop through queues, events and one lock. The manager inherits the parts that meet
there: the callers' `add_request` / `add_requests` / `cancel_request` (`submission.py`), their reading of outputs
(`results.py`) and of the engine's state (`inspection.py`), the loop thread with `pause()` (`generation_loop.py`),
and scoring (`scoring.py`) and the rollout controls (`rollout.py`) built on them. Every request ends with exactly one
terminal output: FINISHED, FAILED or CANCELLED.

Lifecycle, and who may touch the model when:

| phase | the model | `add_request` |
|---|---|---|
| built, not started | untouched | queues (served once started) |
| `start()` | attention switched and linears packed, all or nothing: a start that raises leaves the model as it was | queues |
| running | cbcore's attention inside its steps only; the model's own attention outside them | queues |
| `stop()` called | still cbcore's until the loop has ended | raises RuntimeError |
| the loop ended (stopped, or died) | handed back by the loop itself as it exits | raises RuntimeError (until `start()`) |
| `destroy()` | handed back | raises RuntimeError (for good) |

Under tensor parallelism (a model transformers sharded over several ranks, cbcore/distributed/) one manager runs
on every rank, each built and started on every rank at once; the driver's (rank 0) takes the requests and delivers
the outputs, the others run its steps on their shard.

Mirrors transformers 5.24's `ContinuousBatchingManager` (same constructor, methods, argument names and defaults);
the differences are listed in the README, "Differences from transformers 5.24 and 5.25".
"""

from __future__ import annotations

import logging
import numbers
import queue
import threading
import time
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from .. import request_inputs
from ..config import ContinuousBatchingConfig, as_cbcore_config
from ..distributed import join_group
from ..engine import EngineCore
from ..grammar import GrammarEngine
from ..model_self_check import self_check, self_check_enabled
from ..model_support import check_model_supported
from ..openmp_team import release_caller_openmp_team
from ..outputs import OutputRouter
from ..requests import RequestState
from .generation_config import prepare_generation_config
from .generation_loop import BackgroundThreadStatus, GenerationLoop, StopMode
from .inspection import EngineInspection
from .request_registry import RequestRegistry
from .results import ResultReading
from .rollout import RolloutControl
from .scoring import ContinuationScoring
from .submission import RequestSubmission

logger = logging.getLogger("cbcore")


class ContinuousBatchingManager(RequestSubmission, ResultReading, EngineInspection, ContinuationScoring,
                                RolloutControl, GenerationLoop):
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
        tokenizer: Any = None,
    ) -> None:
        """`tokenizer`: the model's tokenizer, for requests with `structured_output` (their grammars are compiled
        against its vocabulary); None loads it from the model's `name_or_path` when one first asks."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ContinuousBatchingManager: model must be a torch.nn.Module, got {type(model).__name__}")
        request_inputs.manager_configs(
            "ContinuousBatchingManager", generation_config, continuous_batching_config, workload_hints,
            generation_config_required=True,
        )
        # Work on copies: the caller's configs are never mutated (transformers writes eos_token_id=-1 into them).
        self.generation_config = GenerationConfig.from_dict(generation_config.to_dict())
        self.continuous_batching_config = as_cbcore_config(continuous_batching_config)
        self.workload_hints = workload_hints
        if tokenizer is not None and not callable(getattr(tokenizer, "get_vocab", None)):
            raise TypeError(f"ContinuousBatchingManager: tokenizer must be the model's transformers tokenizer (or "
                            f"None), got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self._grammar_engine: GrammarEngine | None = None
        self.model = model.eval()
        self.continuous_batching_config.check_supported(model.device)
        # The config exactly as `model.generate` prepares it (unset values from the model's generation config and
        # global defaults). Built now, as transformers builds its processors in its constructor.
        prepared, self.logit_processor = prepare_generation_config(
            self.model, self.generation_config, self.continuous_batching_config.per_request_processors
        )
        self._prepared_generation_config = prepared
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
        # What callers and the loop share under one lock: id assignment, the ids in flight, the requests queued but
        # not taken in yet (a cancel marks them there), and whether requests are accepted.
        self._requests = RequestRegistry()
        self._destroyed = False
        self._wake_up_loop = threading.Event()
        self._stop_mode = StopMode.RUNNING
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
        # The engine whose step warmup() compiled ahead, so that the start() after it need not again.
        self._compiled_ahead_for: EngineCore | None = None
        self.compile_seconds = 0.0  # spent compiling the step ahead (warmup or start), for logs and the CLI

        # The model is bound to cbcore's attention (engine.binding) by start() and handed back when the loop ends: a
        # manager that is built but never started leaves the model untouched (transformers switches it in __init__).
        self._use_prefix_sharing = self.continuous_batching_config.allow_block_sharing

        # Tensor parallelism (cbcore/distributed/): a model transformers sharded over a group of ranks gets one
        # manager per rank, built on every rank at once (joining creates the group's CPU channel). The driver (rank
        # 0) takes requests and delivers outputs; the other ranks run what it sends (transformers' `is_tp_driver`).
        self._tensor_parallel = join_group(self.model, self.continuous_batching_config.cpu_group_timeout)
        self.is_tp_driver = self._tensor_parallel is None or self._tensor_parallel.is_driver

    # ------------------------------------------------------------------------------------------------ set-up ----

    def switch_to_cb_friendly_attn(self, model: torch.nn.Module, auto_switch_to_flash: bool = True) -> None:
        """Point the model's attention at cbcore's paged attention (handed back when the loop ends), building the
        engine first if needed. cbcore always uses its own paged kernels, so `auto_switch_to_flash` has no effect.
        Idempotent. Called by `start()`."""
        request_inputs.flag(auto_switch_to_flash, "switch_to_cb_friendly_attn: auto_switch_to_flash")
        if model is not self.model:
            raise ValueError(
                f"switch_to_cb_friendly_attn: model must be the model this manager serves, got {type(model).__name__}"
            )
        if self.engine is None or self._engine_needs_rebuild:
            self._build_engine()
        self.engine.binding.attach()

    @property
    def _original_attn_impl(self) -> str | None:
        """The attention implementation the model was loaded with, while cbcore's is attached (else None): what
        stopping hands back, exactly (`paged|eager` stays `paged|eager`). The self-check compares cbcore's steps with
        the function it stands for (`model_self_check.reference_attn_implementation`: `eager` for `paged|eager`)."""
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
            tensor_parallel=self._tensor_parallel,
        )
        self._engine_needs_rebuild = False

    def warmup(self) -> None:
        """Build the engine (cache, scheduler, runner) ahead of the first request and, when the step is compiled
        (`default_compile_level`, `varlen_compile_config`, `decode_compile_config`), compile it for every shape a
        step needs, so that no request pays for compilation (the seconds are logged and in `compile_seconds`).
        `start()` does the same when `warmup()` was not called. cbcore has no CUDA graphs to capture yet."""
        self._refuse_if_destroyed("warmup")
        check_model_supported(self.model)  # a model cbcore cannot serve exactly is refused before anything is built
        if self.engine is None or self._engine_needs_rebuild:
            self._build_engine()
        self._compile_ahead(self_checked=False)
        self.warmed_up = True

    def _compile_ahead(self, self_checked: bool) -> None:
        """Compile the step ahead (when it is compiled), after the start-up self-check (run here unless the caller
        `self_checked` already): a model the self-check refuses gets its clear error, not a compiler's error from
        tracing the same forward."""
        if not self.engine.runner.step_forward.compiled:
            return
        if self._compiled_ahead_for is self.engine:  # warmup() did it for this engine; start() need not again
            return
        if not self_checked and self_check_enabled():
            was_attached = self.engine.binding.attached
            self.engine.binding.attach()
            try:
                self_check(self.model, self._original_attn_impl)
            finally:
                if not was_attached:
                    self.engine.binding.detach()
        self.compile_seconds += self.engine.compile_ahead()
        self._compiled_ahead_for = self.engine

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
        if self._tensor_parallel is not None and self._tensor_parallel.broken is not None:
            raise RuntimeError(
                f"cannot start: this manager's tensor-parallel group failed ({self._tensor_parallel.broken}); its "
                "ranks no longer agree on what they ran, so restart every process of the group"
            )
        try:
            check_model_supported(self.model)  # before the model is touched or the engine built
            if self.engine is None or self._engine_needs_rebuild:
                self._build_engine()
            self._attach_to_model()
            if self_check_enabled():  # cbcore's paged path against the model's own forward, before any request
                self_check(self.model, self._original_attn_impl)
            self._compile_ahead(self_checked=True)
        except BaseException:
            self._restore_attn()
            raise
        with self._requests.lock:
            self._requests.closed_reason = None
            self._stop_mode = StopMode.RUNNING
        self.background_thread_status.fatal_error = None
        with self._pause_cond:
            self._loop_parked = False
        use_inference_mode = torch.is_inference_mode_enabled()
        loop_kwargs = {"use_inference_mode": use_inference_mode, "num_threads": torch.get_num_threads()}
        # The loop thread gets its own OpenMP team; the caller's idle one (the self-check above ran parallel ops)
        # would make libgomp wake the loop's workers the slow way in every parallel region (cbcore/openmp_team.py).
        release_caller_openmp_team()
        self._generation_thread = threading.Thread(
            target=self._run_generation_loop, name="cbcore-loop", kwargs=loop_kwargs, daemon=True
        )
        self._generation_thread.start()
        # A later start() (a kept manager's next session) compiles ahead again: graphs may be invalid by then.
        self._compiled_ahead_for = None

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
        tokens stay exact). `join()` waits for that moment.

        Under tensor parallelism the driver decides when the group's work is done: on another rank `stop()` waits for
        the driver's loop to end (which ends this rank's), while `stop(hard_stop=True)` on any rank stops the whole
        group at once. An argument of the wrong type (a `block` other than True / False, a negative `timeout`, ...)
        raises before anything is stopped."""
        block = request_inputs.flag(block, "stop: block")
        timeout = request_inputs.timeout_seconds(timeout, "stop: timeout")
        keep_for_next_session = request_inputs.flag(keep_for_next_session, "stop: keep_for_next_session")
        hard_stop = request_inputs.flag(hard_stop, "stop: hard_stop")
        if self._generation_thread is None:
            logger.warning("Manager not started.")
            return
        if getattr(self._pause_owner, "depth", 0):
            raise RuntimeError(
                "Cannot stop the manager from inside a pause: the loop is paused and cannot exit, so this would wait "
                "forever. Leave the `pause` context before calling `stop`."
            )
        stop_trigger_time = time.perf_counter()
        with self._requests.lock:
            if self._requests.closed_reason is None:
                self._requests.closed_reason = (
                    "the manager is stopping (stop() was called); call start() to serve again"
                )
            # The mode only ever moves towards HARD: a flush stop after a hard one does not undo it.
            self._stop_mode = max(self._stop_mode, StopMode.HARD if hard_stop else StopMode.FLUSH)
        self._wake_up_loop.set()
        if block:
            self.join(stop_trigger_time, timeout)
        if keep_for_next_session:
            self.model._cached_continuous_batching_manager = self

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        """Wait (up to `timeout` seconds) for the background thread to finish; once it has, the model is handed
        back. `stop_trigger_time` (a `time.perf_counter()` reading) only dates the log line."""
        if stop_trigger_time is not None and (isinstance(stop_trigger_time, bool)
                                              or not isinstance(stop_trigger_time, numbers.Real)):
            raise TypeError(
                f"join: stop_trigger_time must be a time.perf_counter() reading (or None), got "
                f"{type(stop_trigger_time).__name__}"
            )
        timeout = request_inputs.timeout_seconds(timeout, "join: timeout")
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
        if self.is_running() and self._stop_mode == StopMode.RUNNING:
            self.stop(block=True)
        with self._requests.lock:
            self._destroyed = True
            self._requests.closed_reason = "this manager was destroyed; build a new one"
        if self.is_running():
            # stop(block=False) (or a timeout) left the loop finishing its requests: it hands back the model and
            # releases the engine itself when it ends, so destroying does not wait for it.
            return
        self._release()

    def _release(self) -> None:
        """Hand the model back and drop the engine, its cache with it (and a tensor-parallel group's CPU channel:
        only `destroy()` releases)."""
        self._restore_attn()
        self.engine = None
        if self._tensor_parallel is not None:
            self._tensor_parallel.destroy()
