"""Turning the logits of the rows that emit a token into tokens (and log-probabilities).

Logits processors come from the model's own `_get_logits_processor(generation_config)`, exactly what
`model.generate` builds. They are applied row by row with that request's own history (prompt + generated tokens)
as `input_ids`, so history-aware processors (repetition penalty, no-repeat n-gram, ...) see the real history rather
than a batch-shaped stand-in. With no processors (plain greedy, the common case) no per-row work is done at all.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList


class Sampler:
    """Greedy or multinomial sampling over processed logits, reproducible with a seed."""

    def __init__(
        self,
        generation_config: GenerationConfig,
        processors: LogitsProcessorList,
        return_logprobs: bool = False,
        seed: int | None = None,
    ) -> None:
        self.do_sample = bool(generation_config.do_sample)
        self.processors = processors
        self.return_logprobs = return_logprobs
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def sample(self, logits: torch.Tensor, histories: list[list[int]]) -> tuple[list[int], list[float] | None]:
        """Pick one token per row of `logits` `[rows, vocab]`; `histories[i]` is row i's prompt + generated tokens."""
        scores = logits.float()
        if len(self.processors):
            rows = []
            for row, history in enumerate(histories):
                input_ids = torch.tensor([history], dtype=torch.long, device=scores.device)
                rows.append(self.processors(input_ids, scores[row : row + 1]))
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
