"""The runner executes a `ScheduledBatch`: packs every scheduled token into one padding-free sequence, builds the
step's metadata once, calls the model's own forward with cbcore's attention, and samples the emitting rows.

Packing order: decode rows (one query token per request) first, then prefill rows; the attention function splits the
batch at `num_decode_tokens`. Logits are computed only for the rows that emit a token (`logits_to_keep` with an index
tensor), so a chunked prefill that does not reach the end of its prompt costs no LM-head work (for a model whose
forward takes `logits_to_keep`; the others compute every row's and the emitting ones are picked).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import ops
from .attention import STEP_KWARG, StepMetadata, paged_step
from .cache import PagedKVCache
from .sampling import SEED_KWARG, Sampler
from .scheduler import ScheduledBatch, ScheduledRequest


@dataclass
class StepResult:
    """Tokens (and log-probabilities) for the requests whose rows emitted one, in batch order."""

    emitted: list[ScheduledRequest]
    tokens: list[int]
    logprobs: list[float] | None


def _block_table_tensor(items: list[ScheduledRequest], device: torch.device) -> torch.Tensor:
    """`[len(items), max_blocks]` int32 block table; padding is block 0, never read past a request's length."""
    width = max((len(item.state.block_table) for item in items), default=1)
    rows = [item.state.block_table + [0] * (width - len(item.state.block_table)) for item in items]
    return torch.tensor(rows, dtype=torch.int32, device=device).view(len(items), width)


class ModelRunner:
    """Runs an unmodified transformers model on packed batches over the paged cache."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, sampler: Sampler) -> None:
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.device = cache.device
        # A forward without `logits_to_keep` (TrOCR, Whisper decoders) computes every row's logits; the emitting
        # rows are picked afterwards. Exact, at the cost of the LM head over a prefill's every token.
        self.takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        # The kernel backend's mode, resolved once for this engine (ops.kernel_mode reads CBCORE_KERNELS).
        self.kernel_mode = ops.kernel_mode()

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, list[int], list[ScheduledRequest]]:
        """Build input ids, positions, the step metadata and the emitting rows for `batch`."""
        decode = [item for item in batch.requests if item.num_tokens == 1]
        prefill = [item for item in batch.requests if item.num_tokens > 1]
        ordered = decode + prefill

        token_ids: list[int] = []
        for item in ordered:
            start = item.state.num_computed_tokens
            token_ids.extend(item.state.all_tokens[start : start + item.num_tokens])
        device = self.device
        q_lens = torch.tensor([item.num_tokens for item in ordered], dtype=torch.long)
        starts = torch.tensor([item.state.num_computed_tokens for item in ordered], dtype=torch.long)
        cu_q = torch.zeros(len(ordered) + 1, dtype=torch.long)
        torch.cumsum(q_lens, 0, out=cu_q[1:])
        num_tokens = int(cu_q[-1])

        # Per token: which request it belongs to and its position in that request.
        request_index = torch.repeat_interleave(torch.arange(len(ordered)), q_lens)
        positions = starts[request_index] + torch.arange(num_tokens) - cu_q[request_index]

        page = self.cache.page_size
        block_table = _block_table_tensor(ordered, torch.device("cpu"))
        slots = block_table[request_index, positions // page].long() * page + positions % page
        seq_lens = (starts + q_lens).to(torch.int32)

        num_decode = len(decode)
        step = StepMetadata(
            key_caches=self.cache.key_caches,
            value_caches=self.cache.value_caches,
            slot_mapping=slots.to(device),
            num_decode_tokens=num_decode,
            decode_block_table=block_table[:num_decode].to(device),
            decode_seq_lens=seq_lens[:num_decode].to(device),
            num_prefill_requests=len(prefill),
            prefill_block_table=block_table[num_decode:].to(device),
            prefill_cu_seqlens_q=(cu_q[num_decode:] - num_decode).to(torch.int32).to(device),
            prefill_seq_lens_k=seq_lens[num_decode:].to(device),
            kernel_mode=self.kernel_mode,
            positions=positions.to(device),
        )
        emitting = [i for i, item in enumerate(ordered) if item.emits_token]
        emit_rows = [int(cu_q[i + 1]) - 1 for i in emitting]
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=device)
        return input_ids, positions.view(1, -1).to(device), step, emit_rows, [ordered[i] for i in emitting]

    @torch.inference_mode()
    def forward(
        self, batch: ScheduledBatch, step_hook: Callable[[StepMetadata], StepMetadata] | None = None
    ) -> tuple[torch.Tensor | None, list[ScheduledRequest]]:
        """Run the model's forward over `batch`: the logits `[len(emitted), vocab]` of the emitting rows (None when
        no row emits) and the requests they belong to. `step_hook` may wrap the step metadata before the forward
        (the start-up self-check counts attention calls through it, cbcore/model_support.py)."""
        input_ids, position_ids, step, emit_rows, emitted = self.prepare(batch)
        if step_hook is not None:
            step = step_hook(step)
        # logits_to_keep needs at least one row; a step of mid-prompt chunks keeps the last row and discards it.
        rows_to_keep = emit_rows if emit_rows else [input_ids.shape[1] - 1]
        rows = torch.tensor(rows_to_keep, dtype=torch.long, device=self.device)
        kept = {"logits_to_keep": rows} if self.takes_logits_to_keep else {}
        with paged_step(step):
            output = self.model(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, **kept, **{STEP_KWARG: step}
            )
        logits = output.logits[0]
        if not self.takes_logits_to_keep and logits.shape[0] == input_ids.shape[1]:
            logits = logits[rows]
        if logits.shape[0] != len(rows_to_keep):
            # A model that ignores logits_to_keep would have every row sampled from the wrong position.
            raise RuntimeError(
                f"{type(self.model).__name__} returned logits for {logits.shape[0]} rows, but cbcore asked for "
                f"{len(rows_to_keep)} (logits_to_keep); this model is not supported"
            )
        return (logits if emitted else None), emitted

    @staticmethod
    def _generator_of(state) -> torch.Generator | None:
        """A request's own generator when it has a seed (made once; it keeps its state across steps, preemption
        and recompute included: tokens already drawn are never drawn again)."""
        seed = state.logit_processor_kwargs.get(SEED_KWARG)
        if seed is None:
            return None
        if state.sampling_generator is None:
            state.sampling_generator = torch.Generator().manual_seed(seed)
        return state.sampling_generator

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one forward over `batch` and sample a token for every request that emits one."""
        logits, emitted = self.forward(batch)
        if not emitted:
            return StepResult([], [], None)
        generators = [self._generator_of(item.state) for item in emitted]
        tokens, logprobs = self.sampler.sample(
            logits,
            [item.state.all_tokens for item in emitted],
            [len(item.state.initial_tokens) for item in emitted],
            [item.state.logit_processor_kwargs for item in emitted],
            [item.state.max_new_tokens for item in emitted],
            generators if any(g is not None for g in generators) else None,  # None: no per-row draw at all
        )
        return StepResult(emitted, tokens, logprobs)
