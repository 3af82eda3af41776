"""The runner executes a step's plan (cbcore/plan.py): issues its block copies, packs every planned token into one
padding-free sequence, builds the step's metadata once, calls the model's own forward with cbcore's attention, and
samples the emitting rows.

Packing order: decode rows (one query token per request) first, then prefill rows; the attention function splits the
batch at `num_decode_tokens`. Logits are computed only for the rows that emit a token (`logits_to_keep` with an index
tensor), so a chunked prefill that does not reach the end of its prompt costs no LM-head work (for a model whose
forward takes `logits_to_keep`; the others compute every row's and the emitting ones are picked).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.generation.configuration_utils import CompileConfig

from . import ops
from .cache import PagedKVCache
from .compiled_step import StepForward
from .plan import BlockCopies, PlannedRequest, StepPlan
from .sampling import Sampler
from .sampling_controls import ControlRow
from .scheduler import ScheduledBatch, ScheduledRequest
from .state_layers import StatePool, StateRow, StateStep
from .step_context import StepMetadata, paged_step


@dataclass
class PromptScores:
    """Prompt logprobs from one step's rows of one request: the entries of positions `start + 1` ..."""

    item: ScheduledRequest
    start: int  # the position of the first scoring row
    logprobs: list[float]
    top_logprobs: list[tuple[list[int], list[float]]]


def score_prompts(logits: torch.Tensor, plan: StepPlan, items: list[ScheduledRequest]) -> list[PromptScores]:
    """The prompt-scoring rows' logits `[rows, vocab]` (in plan order, `prepare`) as each prompt token's logprob
    under the model (the raw logits: no processor, penalty or temperature) and its position's most likely tokens;
    `items` are the step's requests, in plan order.
    The rows are at most the scheduler's prompt-scoring cap per step, so this is never a whole long prompt's
    `[prompt, vocab]` at once."""
    log_softmax = torch.log_softmax(logits.float(), dim=-1)
    targets = [t for request in plan.requests for t in request.score_targets]
    chosen = log_softmax.gather(1, torch.tensor(targets, device=logits.device).view(-1, 1)).squeeze(1).tolist()
    widest = max(request.score_top for request in plan.requests)
    if widest:
        values, ids = log_softmax.topk(widest, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    scores, row = [], 0
    for index, request in enumerate(plan.requests):
        n = request.score_to - request.score_from
        if not n:
            continue
        k = request.score_top
        tops = [(ids[r][:k], values[r][:k]) if k else ([], []) for r in range(row, row + n)]
        scores.append(PromptScores(items[index], request.score_from, chosen[row : row + n], tops))
        row += n
    return scores


@dataclass
class StepResult:
    """Tokens (and log-probabilities) for the requests whose rows emitted one, in batch order."""

    emitted: list[ScheduledRequest]
    tokens: list[int]
    logprobs: list[float] | None
    # Per emitted row, (token ids, logprobs) of its `top_logprobs` most likely tokens; None when no row asked.
    top_logprobs: list[tuple[list[int], list[float]] | None] | None = None
    # Per emitted row, the log of the probability mass its truncating sampler kept (logprobs_mode="processed").
    logprob_mass: list[float | None] | None = None
    # Prompt logprobs computed this step, per request that asked.
    prompt_scores: list[PromptScores] = field(default_factory=list)


def _block_table_tensor(requests: list[PlannedRequest], device: torch.device) -> torch.Tensor:
    """`[len(requests), max_blocks]` int32 block table; padding is block 0, never read past a request's length."""
    width = max((len(request.block_table) for request in requests), default=1)
    rows = [request.block_table + [0] * (width - len(request.block_table)) for request in requests]
    return torch.tensor(rows, dtype=torch.int32, device=device).view(len(requests), width)


class ModelRunner:
    """Runs an unmodified transformers model on packed batches over the paged cache."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, sampler: Sampler,
                 compile_configs: tuple[CompileConfig | None, CompileConfig | None] = (None, None),
                 state_pool: StatePool | None = None) -> None:
        """`compile_configs`: (varlen, decode) compile configs of the step's forward (cbcore/compiled_step.py); None
        runs that path eagerly. `state_pool`: the stateful layers' per-request states (cbcore/state_layers.py), for
        a model that has such layers."""
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.state_pool = state_pool
        self.device = cache.device
        # A forward without `logits_to_keep` (TrOCR, Whisper decoders) computes every row's logits; the emitting
        # rows are picked afterwards. Exact, at the cost of the LM head over a prefill's every token.
        self.takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        # The kernel backend's mode, resolved once for this engine (ops.kernel_mode reads CBCORE_KERNELS).
        self.kernel_mode = ops.kernel_mode()
        # Likewise the cascade switch (CBCORE_CASCADE_DECODE): a typo fails the engine's build, not every step.
        self.cascade_decode = ops.cascade_enabled()
        self.step_forward = StepForward(model, self.takes_logits_to_keep, *compile_configs)

    def copy_blocks(self, copies: BlockCopies) -> None:
        """Issue a step's block copies before its forward, one batched call per direction, device to host first,
        then device to device, then host to device (cbcore/plan.py says why): swaps through the host pool,
        copy-on-write blocks with one index copy per layer tensor."""
        keys, values = self.cache.key_caches, self.cache.value_caches
        pool = self.cache.swap.pool if self.cache.swap is not None else None
        if copies.device_to_host:
            device_blocks, host_blocks = zip(*copies.device_to_host)
            pool.swap_out(keys, values, list(device_blocks), list(host_blocks))
            # The host pool's copies may run on a side stream (CUDA): the device blocks they read must not be
            # overwritten by the fork copies below before they are done.
            pool.wait_on_current_stream()
        if copies.device_to_device:
            sources = torch.tensor([s for s, _ in copies.device_to_device], dtype=torch.long, device=self.device)
            targets = torch.tensor([t for _, t in copies.device_to_device], dtype=torch.long, device=self.device)
            for pages in keys + values:
                pages.index_copy_(0, targets, pages.index_select(0, sources))
        if copies.state_copies:  # forked children start from their parent's state
            self.state_pool.copy_slots(copies.state_copies)
        if copies.host_to_device:
            host_blocks, device_blocks = zip(*copies.host_to_device)
            pool.swap_in(keys, values, list(host_blocks), list(device_blocks))
            pool.wait_on_current_stream()  # the forward reads the blocks swapped in

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, list[int], list[int]]:
        """Build input ids, positions, the step metadata, the rows whose logits are kept and the indices (in
        `plan.requests`) of the requests whose rows emit. The kept rows are the emitting rows (one per emitting
        request, in that order) followed by the prompt-scoring rows (`PlannedRequest.score_from` .. `score_to`, in
        plan order; see `score_prompts`).

        The per-token lists are built in Python and each becomes one tensor: a step's few hundred rows cost less so
        than as a dozen small torch ops (docs/performance_log.md, 2026-12-06)."""
        requests = plan.requests
        decode = [i for i, request in enumerate(requests) if len(request.token_ids) == 1]
        prefill = [i for i, request in enumerate(requests) if len(request.token_ids) > 1]
        order = decode + prefill
        ordered = [requests[i] for i in order]

        page = self.cache.page_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []  # per token: its page's block * page size + its offset in the page
        seq_lens: list[int] = []
        cu_q = [0]
        for request in ordered:
            start, table = request.start, request.block_table
            n = len(request.token_ids)
            end = start + n
            if n == 1:
                token_ids.append(request.token_ids[0])
                positions.append(start)
                slots.append(table[start // page] * page + start % page)
            else:
                token_ids.extend(request.token_ids)
                positions.extend(range(start, end))
                position = start
                while position < end:  # one run of slots per page the tokens reach
                    index = position // page
                    stop = min(end, (index + 1) * page)
                    shift = (table[index] - index) * page
                    slots.extend(range(position + shift, stop + shift))
                    position = stop
            seq_lens.append(end)
            cu_q.append(cu_q[-1] + n)

        device = self.device
        num_decode = len(decode)
        block_table = _block_table_tensor(ordered, device)
        seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        positions_tensor = torch.tensor(positions, dtype=torch.long, device=device)
        step = StepMetadata(
            key_caches=self.cache.key_caches,
            value_caches=self.cache.value_caches,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            num_decode_tokens=num_decode,
            decode_block_table=block_table[:num_decode],
            decode_seq_lens=seq_lens_tensor[:num_decode],
            num_prefill_requests=len(prefill),
            prefill_block_table=block_table[num_decode:],
            prefill_cu_seqlens_q=torch.tensor([c - num_decode for c in cu_q[num_decode:]], dtype=torch.int32,
                                              device=device),
            prefill_seq_lens_k=seq_lens_tensor[num_decode:],
            kernel_mode=self.kernel_mode,
            cascade_decode=self.cascade_decode,
            positions=positions_tensor,
        )
        if self.state_pool is not None:
            step.states = StateStep(self.state_pool, [
                StateRow(cu_q[i], len(request.token_ids), request.state_slot, request.start > 0)
                for i, request in enumerate(ordered)
            ])
        emitting = [i for i, request in enumerate(ordered) if request.emits_token]
        kept_rows = [cu_q[i + 1] - 1 for i in emitting]
        # Then the rows that score a prompt (prompt_logprobs), in plan order as `score_prompts` reads them (a one-token
        # chunk packs among the decode rows, so the packing order may differ).
        scoring = [index for index, request in enumerate(requests) if request.score_to > request.score_from]
        packed_at = {index: position for position, index in enumerate(order)} if scoring else {}
        for index in scoring:
            request = requests[index]
            first = cu_q[packed_at[index]] + request.score_from - request.start
            kept_rows.extend(range(first, first + request.score_to - request.score_from))
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=device)
        return input_ids, positions_tensor.view(1, -1), step, kept_rows, [order[i] for i in emitting]

    @torch.inference_mode()
    def forward(
        self, plan: StepPlan, step_hook: Callable[[StepMetadata], StepMetadata] | None = None
    ) -> tuple[torch.Tensor | None, list[int]]:
        """Run the model's forward over `plan`'s requests: the logits of the kept rows (`prepare`: the emitting rows
        `[len(emitted), vocab]`, then any prompt-scoring rows; None when no row is kept) and the indices in
        `plan.requests` of the requests whose rows emit. The plan's block
        copies must have been issued (`copy_blocks`). `step_hook` may wrap the step metadata before the forward (the
        start-up self-check counts attention calls through it, cbcore/model_self_check.py)."""
        input_ids, position_ids, step, kept_rows, emitted = self.prepare(plan)
        if step_hook is not None:
            step = step_hook(step)
        # logits_to_keep needs at least one row; a step of mid-prompt chunks keeps the last row and discards it.
        rows_to_keep = kept_rows if kept_rows else [input_ids.shape[1] - 1]
        rows = torch.tensor(rows_to_keep, dtype=torch.long, device=self.device)
        with paged_step(step):
            logits = self.step_forward(input_ids, position_ids, rows, step, decode_only=not step.num_prefill_requests)
        logits = logits[0]
        if not self.takes_logits_to_keep and logits.shape[0] == input_ids.shape[1]:
            logits = logits[rows]
        if logits.shape[0] != len(rows_to_keep):
            # A model that ignores logits_to_keep would have every row sampled from the wrong position.
            raise RuntimeError(
                f"{type(self.model).__name__} returned logits for {logits.shape[0]} rows, but cbcore asked for "
                f"{len(rows_to_keep)} (logits_to_keep); this model is not supported"
            )
        return (logits if kept_rows else None), emitted

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one forward over `batch`'s plan and sample a token for every request that emits one (its block
        copies issued before, by `copy_blocks`)."""
        plan = batch.plan()
        logits, indices = self.forward(plan)
        emitted = [batch.requests[i] for i in indices]
        prompt_scores = []
        if logits is not None and logits.shape[0] > len(emitted):
            prompt_scores = score_prompts(logits[len(emitted):], plan, batch.requests)
            logits = logits[: len(emitted)]
        if not emitted:
            return StepResult([], [], None, prompt_scores=prompt_scores)
        generators = [item.state.sampling_generator for item in emitted]
        controls = [ControlRow(row, item.state.sampling_controls, item.state.initial_tokens,
                               item.state.generated_tokens, item.state.finish_token_ids)
                    for row, item in enumerate(emitted) if item.state.sampling_controls]
        sampled = self.sampler.sample(
            logits,
            [item.state.all_tokens for item in emitted],
            [len(item.state.initial_tokens) for item in emitted],
            [item.state.logit_processor_kwargs for item in emitted],
            [item.state.max_new_tokens for item in emitted],
            generators if any(g is not None for g in generators) else None,  # None: no per-row draw at all
            controls or None,
            [(row, item.state.grammar) for row, item in enumerate(emitted) if item.state.grammar is not None] or None,
        )
        return StepResult(emitted, sampled.tokens, sampled.logprobs, sampled.top_logprobs, sampled.logprob_mass,
                          prompt_scores)
