"""`EngineCore`: one step at a time, no threads. `step()` = schedule (a `ScheduledBatch` and its `StepPlan` of ids
and ints) → the runner issues the plan's block copies and runs it → `update_from_output` advances the requests.

The core owns the cache, the scheduler and the runner. It is driven by the manager's loop thread, and directly by
tests and the profiler. Every call returns the outputs it produced (streaming snapshots and terminal outputs), in
order; whoever drives the core delivers them. A request ends exactly once, in `_end`: with it end its children that
were not forked yet (with its status and error), and its blocks are released.

    core = EngineCore(model, prepared_generation_config, cb_config, workload_hints)
    core.binding.attach()                   # cbcore's attention (and packed linears) while serving
    outputs = core.add_request(state)       # [] when admitted to the queue, [FAILED output] when its prompt is bad
    while core.has_work():
        outputs += core.step()
    core.binding.detach()
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time

import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from ..cache import PagedKVCache
from ..cache_shape import CacheShape
from ..config import ContinuousBatchingConfig
from ..distributed.driver import make_runner
from ..distributed.errors import TensorParallelError
from ..distributed.group import TensorParallelGroup
from ..compiled_step import resolve_compile_configs
from ..model_support import check_stateful_options
from ..requests import GenerationOutput, RequestState, RequestStatus, child_request_id, split_child_id
from ..runner import StepResult
from ..sampling import LogitsProcessorSwitch, Sampler
from ..scheduler import ScheduledBatch, ScheduledRequest, Scheduler
from ..scheduling_orders import SCHEDULING_ORDERS
from ..state_layers import StatePool
from ..state_specs import probe_state_specs, state_layer_modules
from ..state_slots import StateSlots
from ..switches import env_switch
from .allocation import allocate_state_pool, enable_swap
from .model_binding import ModelBinding
from .request_checks import check_step_writes, prompt_problem
from .sizing import absolute_position_limit, allocation_error, plan_sizes
from .stats import engine_stats

logger = logging.getLogger("cbcore")

# CBCORE_DEBUG=1 (on in the test suite): every step's plan is checked before it runs (each block a step writes is
# held by its request alone and inside the cache) and the cache's invariants after it (allocator, refcounts equal to
# the block tables). Read when an engine is built. Off by default: O(blocks) per step.
DEBUG_ENV = "CBCORE_DEBUG"
# The logits a step keeps for prompt logprobs, `[rows, vocab]` fp32, stay under this: a request scoring its prompt runs
# at most that many prompt tokens per step (1365 rows of SmolLM2's 49k vocabulary, 431 of a 152k one).
PROMPT_SCORING_BYTES = 256 * 2**20


class EngineCore:
    """The cache, scheduler and runner of one model, stepped by whoever drives it (never by a thread of its own)."""

    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: GenerationConfig,
        cb_config: ContinuousBatchingConfig,
        workload_hints: WorkloadHints | None = None,
        logit_processor: LogitsProcessorSwitch | None = None,
        do_sample: bool | None = None,
        tensor_parallel: TensorParallelGroup | None = None,
    ) -> None:
        """Size and allocate the cache and build the scheduler, sampler and runner (all or nothing: an error leaves
        nothing allocated). `generation_config` is prepared as `model.generate` prepares it and builds the logits
        processors; `do_sample` (default: the config's) says whether tokens are sampled or taken greedily from the
        processed logits. The resolved sizes are written back into `cb_config`, as transformers does after creating
        its cache. Under tensor parallelism (`tensor_parallel`: this rank's group) every rank builds its engine at
        once: the block counts are the smallest over the ranks, and the driver's runner sends its work to the others
        (cbcore/distributed/)."""
        self.model = model
        self._tensor_parallel = tensor_parallel
        self.binding = ModelBinding(model)
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self._position_limit = absolute_position_limit(model)
        device = model.device
        shape = CacheShape.from_model(model, model.dtype)
        # Layers with a per-request state (hybrid and recurrent models): one slot per running request.
        state_specs = probe_state_specs(model) if state_layer_modules(model) else []
        compile_configs = resolve_compile_configs(cb_config, generation_config)
        if state_specs:
            check_stateful_options(model, compile_configs, tensor_parallel)
        sizes = plan_sizes(model, shape, cb_config, workload_hints, StatePool.bytes_per_slot(state_specs))
        if tensor_parallel is not None:  # sized from each rank's own memory; the driver's block ids exist everywhere
            (num_blocks,) = tensor_parallel.agree_min([sizes.num_blocks], "the number of KV-cache blocks")
            sizes = dataclasses.replace(sizes, num_blocks=num_blocks)
        state_slots = StateSlots(sizes.num_state_slots) if state_specs else None
        # Prefix sharing needs each shared prefix's state too (snapshots at block boundaries), which cbcore does not
        # keep yet: a model with stateful layers computes every prompt whole (forks still share their parent's K/V).
        allow_prefix_sharing = cb_config.allow_block_sharing and not state_specs
        self.state_pool = allocate_state_pool(state_specs, sizes.num_state_slots, device)
        try:
            self.cache = PagedKVCache(shape, sizes.num_blocks, cb_config.page_size, device, allow_prefix_sharing,
                                      state_slots)
        except (RuntimeError, MemoryError, OSError) as error:  # torch: RuntimeError; a large CPU cache's mmap: OSError
            percent = cb_config.max_memory_percent
            option = (f"num_blocks={sizes.num_blocks}" if cb_config.num_blocks is not None else
                      f"max_memory_percent{'' if percent is None else f'={percent}'} (num_blocks=None was sized from "
                      f"it{' (its default)' if percent is None else ''} to {sizes.num_blocks}), or set num_blocks")
            needed = sizes.num_blocks * cb_config.page_size * shape.bytes_per_token
            raise allocation_error(f"KV cache of {sizes.num_blocks} blocks x page_size={cb_config.page_size}", option,
                                   needed, device, error) from error
        if cb_config.cpu_offload_space is None or cb_config.cpu_offload_space > 0:
            enable_swap(self.cache, shape, cb_config, tensor_parallel)
        self.scheduler = Scheduler(
            self.cache,
            SCHEDULING_ORDERS[cb_config.scheduler_type](),
            max_batch_tokens=sizes.max_batch_tokens,
            max_requests_per_batch=sizes.max_requests_per_batch,
            safety_margin=cb_config.safety_margin,
            prompt_scoring_rows=max(16, PROMPT_SCORING_BYTES // (4 * self._vocab_size)),
        )

        def processors_for(prompt_length: int, max_new_tokens: int | None, overrides: dict):
            # As `model.generate` prepares a call: max_length counts from this prompt, so length-dependent
            # processors (forced EOS at max_length - 1, ...) fire where they would for this request alone.
            config = copy.deepcopy(generation_config)
            if max_new_tokens is not None:
                config.max_length = prompt_length + max_new_tokens
            for name, value in overrides.items():
                setattr(config, name, value)
            return model._get_logits_processor(config, input_ids_seq_length=prompt_length, device=device)

        sampler = Sampler(
            generation_config, processors_for, cb_config.return_logprobs, cb_config.seed,
            cb_config.per_request_processors, logit_processor, do_sample,
        )
        self.runner = make_runner(tensor_parallel, model, self.cache, sampler, compile_configs, self.state_pool)
        cb_config.num_blocks = sizes.num_blocks
        cb_config.max_batch_tokens = sizes.max_batch_tokens
        cb_config.max_requests_per_batch = sizes.max_requests_per_batch
        self.counters = {
            "steps": 0,
            "computed_tokens": 0,
            "computed_prompt_tokens": 0,
            "recomputed_tokens": 0,
            "generated_tokens": 0,
        }
        # The parameters' in-place version counters when last looked at (see notice_weight_changes).
        self._weights_signature: int | None = None
        self.debug = env_switch(DEBUG_ENV, default=False)

    # ---- requests in and out -----------------------------------------------------------------------------------

    def add_request(self, state: RequestState) -> list[GenerationOutput]:
        """Queue a request whose arguments were checked (request_inputs). A bad prompt ends it at once: the returned
        list then holds its FAILED output (and its children's)."""
        problem = prompt_problem(state, self._vocab_size, self._position_limit, self.cache,
                                 type(self.model).__name__)
        if problem is not None:
            state.error = f"request {state.request_id}: {problem}"
            logger.warning(state.error)
            return self.end_unadmitted(state, RequestStatus.FAILED)
        self.scheduler.add(state)
        return []

    def end_unadmitted(self, state: RequestState, status: RequestStatus) -> list[GenerationOutput]:
        """End a request the scheduler never held (cancelled or failed before it was queued here)."""
        return self._end(state, status, track=False)

    def abort(self, request_id: str) -> list[GenerationOutput]:
        """Cancel a request, or a child of a live request that was not forked yet (it is then never forked). An id
        that is not live does nothing, and so does one that is not a str (no request has it)."""
        if not isinstance(request_id, str):
            return []
        live = self.scheduler.live_requests()
        state = next((s for s in live if s.request_id == request_id), None)
        if state is not None:
            return self._end(state, RequestStatus.CANCELLED)
        parent_id, index = split_child_id(request_id)
        parent = next((s for s in live if s.request_id == parent_id), None) if parent_id is not None else None
        if parent is None or index >= parent.num_children or index in parent.cancelled_children:
            return []
        parent.cancelled_children.add(index)
        child = parent.fork_child(request_id)
        child.status = RequestStatus.CANCELLED
        return [child.to_generation_output()]

    def fail_all(self, reason: str, also: list[RequestState] = ()) -> list[GenerationOutput]:
        """Fail every request held, plus `also` (requests never handed to the core), keeping their partial tokens."""
        outputs = []
        for state in self.scheduler.live_requests():
            state.error = f"request {state.request_id}: {reason}"
            outputs += self._end(state, RequestStatus.FAILED)
        for state in also:
            state.error = f"request {state.request_id}: {reason}"
            outputs += self._end(state, RequestStatus.FAILED, track=False)
        return outputs

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_work()

    def live_requests(self) -> list[RequestState]:
        """Every request the core holds (waiting or running)."""
        return self.scheduler.live_requests()

    # ---- the step ----------------------------------------------------------------------------------------------

    def step(self) -> list[GenerationOutput]:
        """Schedule, run and advance one step; the outputs it produced (streaming snapshots, terminal outputs)."""
        if not self.binding.attached:
            raise RuntimeError(
                "EngineCore.step() needs the model bound to cbcore's attention (engine.binding.attach()); unbound, "
                "its forward would ignore the paged cache"
            )
        outputs: list[GenerationOutput] = []
        batch = self.scheduler.schedule()
        for state in batch.filled_the_cache:
            # Generation reached the cache's capacity with this request alone in it: end it like a length limit.
            outputs += self._end(state, RequestStatus.FINISHED)
        for state, reason in batch.failed:
            state.error = f"request {state.request_id}: {reason}"
            outputs += self._end(state, RequestStatus.FAILED)
        # Forks' copy-on-write blocks, swaps and host-tier moves, one batched call per direction, before the forward
        # (also in a step that runs nothing: a swap-out must land before its device blocks are reused).
        self.runner.copy_blocks(batch.copies)
        if not batch.requests:
            return outputs
        if self.debug:
            check_step_writes(batch, self.cache)
        started = time.perf_counter()
        results, failures = self._execute_isolating_failures(batch.requests)
        for item, error in failures:
            item.state.error = f"request {item.state.request_id}: this step failed: {type(error).__name__}: {error}"
            outputs += self._end(item.state, RequestStatus.FAILED)
        if not failures and self.cache.swap is not None and any(item.num_tokens > 1 for item in batch.requests):
            self.cache.swap.policy.observe_prefill(batch.num_tokens, time.perf_counter() - started)
        failed = {id(item) for item, _ in failures}
        succeeded = [item for item in batch.requests if id(item) not in failed]
        if failures and self.state_pool is not None:
            # Isolating the culprit ran parts of the step again, and a recurrent state, unlike K/V, is not rewritten
            # with the same values: the others' states advanced more than once. They are recomputed from their tokens
            # (the same output), their results from those runs dropped.
            for item in succeeded:
                self.scheduler.recompute(item.state)
            succeeded = []
        if succeeded:
            outputs += self.update_from_output(ScheduledBatch(requests=succeeded), results)
        if self.debug:
            self.check()
        return outputs

    def update_from_output(self, batch: ScheduledBatch, results: list[StepResult]) -> list[GenerationOutput]:
        """The one place that advances requests after a step: counters, computed tokens and full blocks committed
        to the prefix cache (the scheduler's `on_step_done`), sampled tokens appended, finished requests ended and
        freed; returns the outputs (streaming snapshots, terminal outputs)."""
        outputs: list[GenerationOutput] = []
        self._account(batch)
        self.scheduler.on_step_done(batch)
        for result in results:
            for scores in result.prompt_scores:
                scores.item.state.add_prompt_logprobs(scores.start, scores.logprobs, scores.top_logprobs)
            logprobs = result.logprobs or [None] * len(result.tokens)
            tops = result.top_logprobs or [None] * len(result.tokens)
            masses = result.logprob_mass or [None] * len(result.tokens)
            for item, token, logprob, top, mass in zip(result.emitted, result.tokens, logprobs, tops, masses):
                state = item.state
                if state.status != RequestStatus.DECODING:  # the setter stamps times: only on a change
                    state.status = RequestStatus.DECODING
                self.counters["generated_tokens"] += 1
                grammar = state.grammar
                if grammar is not None and not grammar.accept(token):
                    # Only a token the mask allowed can be sampled, unless every token was disallowed (a control
                    # such as min_tokens or bad words forbidding the one token the grammar allows).
                    state.error = (f"request {state.request_id}: structured_output: token {token} is not allowed by "
                                   "its grammar here (every allowed token was ruled out by its sampling controls)")
                    outputs += self._end(state, RequestStatus.FAILED)
                    continue
                if state.append_token(token, logprob, top, mass) or (grammar is not None and grammar.terminated):
                    outputs += self._end(state, RequestStatus.FINISHED)
                elif state.streaming:
                    outputs.append(state.to_generation_output())
        return outputs

    def _execute_isolating_failures(self, items: list[ScheduledRequest]) -> tuple[list, list]:
        """Run the step; if its forward or sampling raises, find the request(s) responsible by running halves of the
        batch again (bisection), so only the culprit fails: a request whose processor raises, or whose position
        runs past the model's table, fails alone and the others of its step go on. Rerunning is exact: a request's
        K/V is rewritten with the same values into its own blocks; a recurrent state is not, so `step()` recomputes the
        other requests of a failed step of a model with stateful layers. Returns (step results, [(item, error)])."""
        try:
            return [self.runner.execute(ScheduledBatch(requests=items))], []
        except TensorParallelError:  # a rank of the group failed: no request's fault, nothing to isolate
            raise
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
        # Summed locally and added once: this runs for every request of every step.
        computed = prompt_tokens = recomputed = 0
        for item in batch.requests:
            state = item.state
            start = state.num_computed_tokens
            end = start + item.num_tokens
            computed += item.num_tokens
            prompt_length = len(state.initial_tokens)
            if start < prompt_length:
                prompt_tokens += min(end, prompt_length) - start
            if start < state.max_computed_tokens:
                recomputed += min(end, state.max_computed_tokens) - start
            if end > state.max_computed_tokens:
                state.max_computed_tokens = end
        counters = self.counters
        counters["steps"] += 1
        counters["computed_tokens"] += computed
        counters["computed_prompt_tokens"] += prompt_tokens
        counters["recomputed_tokens"] += recomputed

    def _end(self, state: RequestState, status: RequestStatus, track: bool = True) -> list[GenerationOutput]:
        """A request's one terminal output, its blocks released; children it has not forked yet end with it, with
        its status and error (they would otherwise never get an output)."""
        if track:
            self.scheduler.finish(state)
        state.status = status
        outputs = []
        for index in range(state.num_children):
            if index in state.cancelled_children:
                continue  # already ended CANCELLED
            child = state.fork_child(child_request_id(state.request_id, index))
            child.status = status
            if state.error is not None:
                child.error = f"request {child.request_id}: its parent {state.error}"
            outputs.append(child.to_generation_output())
        state.num_children = 0
        outputs.append(state.to_generation_output())
        return outputs

    # ---- weights and inspection --------------------------------------------------------------------------------

    def compile_ahead(self) -> float:
        """Compile the step's forward for every shape a step needs (cbcore/compiled_step.py), with the model bound
        as it is while serving; returns the seconds it took (0.0 when nothing is compiled; milliseconds when the
        graphs exist and are still valid)."""
        forward = self.runner.step_forward
        if not forward.compiled:
            return 0.0
        was_attached = self.binding.attached
        self.binding.attach()
        try:
            return forward.warmup(self._vocab_size).total_seconds
        finally:
            if not was_attached:
                self.binding.detach()

    def notice_weight_changes(self, changed_elsewhere: bool = False) -> bool:
        """If any parameter changed in place or was given other storage since the last look (an update inside
        `pause()`, an optimizer step between two sessions of a kept manager), K/V cached for the old weights must not
        be shared with new requests, so the prefix cache is invalidated. Weights can change only while the loop is
        parked or stopped, so the loop looks when it starts and when a pause is released, not every step.
        `changed_elsewhere`: another tensor-parallel rank's shard changed (its K/V shard is stale), so invalidate even
        if this one's did not. Returns whether this process's parameters changed.

        Also where the model's structure is checked (cbcore/structure_fingerprint.py: its compiled step assumes
        it): a change (a hook added, a module's attribute set, a parameter of another shape) compiles the step
        again, now, before the next step runs."""
        if self.runner.step_forward.notice_structure_changes():
            self.compile_ahead()
        # The storage too: `param.data = ...` (model.to(), .half()) swaps it without moving the version counter.
        signature = hash(tuple((id(p), p._version, p.data_ptr()) for p in self.model.parameters()))
        changed = self._weights_signature is not None and signature != self._weights_signature
        if changed:
            self.binding.notice_replaced_weights()
        if changed or changed_elsewhere:
            dropped = self.cache.invalidate_prefixes()
            logger.info(f"cbcore: the model's weights changed; {dropped} cached prefix blocks will not be shared")
        self._weights_signature = signature
        return changed

    def check(self) -> None:
        """Assert the allocator's invariants and that block refcounts equal the block tables holding them."""
        self.cache.check(self.scheduler.live_requests())

    def stats(self) -> dict[str, int | float]:
        """The counters of `ContinuousBatchingManager.stats()` (see there)."""
        return engine_stats(self)
