"""Scoring continuations: the log-likelihood of each continuation given its prompt, as evaluation harnesses ask it.

lm-evaluation-harness's `loglikelihood` requests are (context, continuation) pairs answered with the continuation's
summed logprob and whether greedy decoding would have produced it; `ContinuousBatchingManager.score` answers a batch
of them through the engine's prompt logprobs (each pair is one request over context + continuation with
`prompt_logprobs=1`, so the scores come out of the prefill, chunk by chunk, batched with whatever else runs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .. import request_inputs
from ..requests import GenerationOutput

# How long `score` waits for its requests unless told (they are prefills only: seconds even for long contexts).
DEFAULT_SCORE_TIMEOUT_S = 600.0


@dataclass
class ContinuationScore:
    """One continuation's score: the sum of its tokens' logprobs given the prompt and the tokens before them, each
    token's logprob, and whether every token was the model's most likely one there (lm-eval's `is_greedy`)."""

    logprob: float
    is_greedy: bool
    token_logprobs: list[float]


class ContinuationScoring:
    """The manager's `score` (mixed into `ContinuousBatchingManager`)."""

    def score(self, prompts: list[list[int]], continuations: list[list[int]],
              timeout: float | None = DEFAULT_SCORE_TIMEOUT_S) -> list[ContinuationScore]:
        """The log-likelihood of `continuations[i]` after `prompts[i]`, for every i (token ids; the manager must be
        started). Every pair runs as one request alongside whatever else the manager serves; raises TypeError /
        ValueError for malformed arguments (an empty prompt: its first token has no logprob; an empty
        continuation), RuntimeError naming the pair when its request fails, TimeoutError past `timeout` seconds."""
        prompts = request_inputs.batch_of_token_ids(prompts, "score: prompts")
        continuations = request_inputs.batch_of_token_ids(continuations, "score: continuations")
        timeout = request_inputs.timeout_seconds(timeout, "score: timeout")
        if len(prompts) != len(continuations):
            raise ValueError(f"score: {len(prompts)} prompts but {len(continuations)} continuations")
        for index, (prompt, continuation) in enumerate(zip(prompts, continuations)):
            if not prompt:
                raise ValueError(f"score: prompts[{index}] is empty (the first token of a sequence has no logprob)")
            if not continuation:
                raise ValueError(f"score: continuations[{index}] is empty")
        ids = [self.add_request(prompt + continuation, max_new_tokens=1, prompt_logprobs=1)
               for prompt, continuation in zip(prompts, continuations)]
        if ids and ids[0] is None:  # a tensor-parallel rank other than the driver: the driver scores
            return []
        outputs = self._finals(ids, timeout)
        return [_score(outputs[rid], len(prompt), index)
                for index, (rid, prompt) in enumerate(zip(ids, prompts))]

    def _finals(self: Any, ids: list[str], timeout: float | None) -> dict[str, GenerationOutput]:
        """Each request's terminal output; on a timeout, the requests still running are cancelled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        finals: dict[str, GenerationOutput] = {}
        try:
            for rid in ids:
                while rid not in finals:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"score: {len(ids) - len(finals)} of {len(ids)} requests not done after "
                                           f"{timeout} s")
                    output = self.get_result(request_id=rid, timeout=1.0 if left is None else min(left, 1.0))
                    if output is None and not self.is_running():
                        raise RuntimeError("score: the manager's loop is not running")
                    if output is not None and output.is_finished():
                        finals[rid] = output
        except BaseException:
            for rid in ids:
                if rid not in finals:
                    self.cancel_request(rid)
            raise
        return finals


def _score(output: GenerationOutput, prompt_length: int, index: int) -> ContinuationScore:
    if output.error is not None or output.prompt_logprobs is None:
        raise RuntimeError(f"score: pair {index} ({output.request_id}) failed: {output.error or output.status.name}")
    scored = output.prompt_logprobs
    logprobs = scored.token_logprobs[prompt_length:]
    greedy = all(logprob >= top[1][0] for logprob, top in zip(logprobs, scored.top_logprobs[prompt_length:]))
    return ContinuationScore(sum(logprobs), greedy, list(logprobs))
