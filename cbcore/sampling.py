"""Turning the logits of the rows that emit a token into tokens (and log-probabilities).

Logits processors come from the model's own `_get_logits_processor(generation_config, input_ids_seq_length)`,
exactly what `model.generate` builds for a prompt of that length (processors such as min_new_tokens count from the
prompt's end, so they are built per prompt length and cached). They are applied row by row with that request's own
history (prompt + generated tokens) as `input_ids`, so history-aware processors (repetition penalty, no-repeat n-gram,
...) see the real history rather than a batch-shaped stand-in. With no processors (plain greedy, the common case) no
per-row work is done at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import GenerationConfig, LogitsProcessorList

ProcessorFactory = Callable[[int], LogitsProcessorList]


class Sampler:
    """Greedy or multinomial sampling over processed logits, reproducible with a seed."""

    def __init__(
        self,
        generation_config: GenerationConfig,
        processor_factory: ProcessorFactory,
        return_logprobs: bool = False,
        seed: int | None = None,
    ) -> None:
        """`processor_factory(prompt_length)` builds the processors `model.generate` would use for that prompt."""
        self.do_sample = bool(generation_config.do_sample)
        self._processor_factory = processor_factory
        self._processors_by_prompt_length: dict[int, LogitsProcessorList] = {}
        self.has_processors = len(processor_factory(1)) > 0
        self.return_logprobs = return_logprobs
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def processors_for(self, prompt_length: int) -> LogitsProcessorList:
        """The processors for a prompt of this length (built once per length)."""
        processors = self._processors_by_prompt_length.get(prompt_length)
        if processors is None:
            processors = self._processor_factory(prompt_length)
            self._processors_by_prompt_length[prompt_length] = processors
        return processors

    def sample(
        self, logits: torch.Tensor, histories: list[list[int]], prompt_lengths: list[int]
    ) -> tuple[list[int], list[float] | None]:
        """Pick one token per row of `logits` `[rows, vocab]`; `histories[i]` is row i's prompt + generated tokens
        and `prompt_lengths[i]` the length of its prompt."""
        scores = logits.float()
        if self.has_processors:
            rows = []
            for row, (history, prompt_length) in enumerate(zip(histories, prompt_lengths)):
                input_ids = torch.tensor([history], dtype=torch.long, device=scores.device)
                rows.append(self.processors_for(prompt_length)(input_ids, scores[row : row + 1]))
            scores = torch.cat(rows, dim=0)
        if self.do_sample:
            probs = torch.softmax(scores, dim=-1).cpu()
            tokens = torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)
        else:
            tokens = scores.argmax(dim=-1).cpu()
        logprobs = None
        if self.return_logprobs:
            log_softmax = torch.log_softmax(scores, dim=-1).cpu()
            logprobs = log_softmax.gather(1, tokens.view(-1, 1)).squeeze(1).tolist()
        return tokens.tolist(), logprobs
