"""Adding and cancelling requests on a manager, on the caller's thread: arguments checked, an id, the input queue.

Everything the caller can be told at once is raised by `add_request` itself, before anything is queued: a malformed
argument (`request_inputs` names it), an id still in flight, a manager that does not accept requests. What only the
engine can judge (the prompt against the vocabulary, the cache, the position table) ends that request alone with a
FAILED output, on the loop thread. A request is queued under the same lock as `stop()` closes the manager, so it is
either queued before stopping began (and served) or refused.
"""

from __future__ import annotations

import queue
import time
from typing import Any

import torch

from .. import request_inputs
from ..grammar import GrammarEngine, GrammarError, engine_for
from ..request_inputs import PROMPT_LOGPROBS_KWARG
from ..requests import RequestState
from ..sampling_controls import CONTROL_KWARGS
from ..structured_output import STRUCTURED_OUTPUT_KWARG

# How long add_request waits for room in a full input queue (max_queue_size) before raising queue.Full, as transformers.
ADD_REQUEST_TIMEOUT_S = 10.0


class RequestSubmission:
    """The half of `ContinuousBatchingManager` that callers use to add and cancel requests. The state it shares with
    the loop (the input and cancel queues, the request registry, the wake-up event) is created by
    `ContinuousBatchingManager.__init__`."""

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

        `logit_processor_kwargs`: transformers' `temperature`, `top_k`, `top_p` (with `per_request_processors=True`,
        as there), and cbcore's own, which need no such switch: `seed` (the request draws from a generator of its
        own), `top_logprobs=n` (per generated token, the model's own log-probabilities of the chosen token and of its
        n most likely tokens: `GenerationOutput.top_logprobs`, and `logprobs` with `return_logprobs`),
        `logprobs_mode` ("raw" or "processed", cbcore/sampling.py), `prompt_logprobs=k` (the prompt's tokens'
        logprobs and k alternatives: `GenerationOutput.prompt_logprobs`), `priority` (an int, lower first: see
        cbcore/scheduler.py), and the sampling controls `repetition_penalty`, `frequency_penalty`,
        `presence_penalty`, `logit_bias`, `min_p`, `min_tokens`, `stop_token_ids`, `ignore_eos`, `bad_words_ids`
        (vLLM's semantics: cbcore/sampling_controls.py), and `structured_output` (a `cbcore.StructuredOutput` or a
        dict of its fields: a JSON schema, any JSON object, a regex, a choice list, an EBNF grammar or a structural
        tag the generated text must follow; needs the model's tokenizer, `ContinuousBatchingManager(...,
        tokenizer=)`; a constraint that does not compile ends the request FAILED naming the problem).

        Raised here, before anything is queued, naming the argument: a wrong type (`TypeError`: token ids that are
        not ints, `max_new_tokens="5"` or `2.5`, a non-str `request_id`, a `streaming` or `record_timestamps` other
        than True / False), a value out of range (`ValueError`: `max_new_tokens < 1`, a per-request temperature of 0),
        an id that is still in flight (`ValueError`: two live requests with one id would be indistinguishable to
        anyone routing outputs by id), and a manager that does not accept requests (`RuntimeError`: stopping, stopped,
        crashed or destroyed). Token ids may be a list of ints, or a 1-D integer tensor or numpy array.

        Problems of the prompt itself (empty, ids outside the vocabulary, longer than the cache or the model's
        position table) end this request alone with a FAILED output naming it, so one bad prompt of a batch does not
        stop the others. Raises `queue.Full` when `max_queue_size` is reached and no slot frees up within 10 s (as
        transformers does).

        Under tensor parallelism only the driver (rank 0) takes requests: on another rank this returns None and
        queues nothing, as in transformers (the driver's requests run on every rank)."""
        if not self.is_tp_driver:
            return None
        request_id = request_inputs.request_id(request_id)
        label = f"request {request_id}" if request_id is not None else "add_request"
        state = self._new_state(
            request_inputs.token_ids(input_ids, f"{label}: input_ids"),
            request_id,
            request_inputs.max_new_tokens(max_new_tokens, f"{label}: max_new_tokens"),
            request_inputs.flag(streaming, f"{label}: streaming"),
            request_inputs.flag(record_timestamps, f"{label}: record_timestamps"),
            request_inputs.eos_token_id(eos_token_id, f"{label}: eos_token_id"),
            self._checked_processor_kwargs(logit_processor_kwargs, label),
        )
        with self._requests.lock:
            self._check_accepting()
            self._requests.register(state)
        self._enqueue(state)
        return state.request_id

    def add_requests(
        self,
        inputs: list[list[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        **logit_processor_kwargs: Any,
    ) -> list[str] | None:
        """Queue several requests; returns their ids in input order. Every argument is checked before any request is
        queued (errors name the prompt's index); `inputs` may be a list of prompts or a 2-D integer tensor / array.
        With prefix sharing, they are queued sorted by content (as transformers does) so that requests sharing a
        prefix run one after another. On a tensor-parallel rank other than the driver: None, nothing queued."""
        if not self.is_tp_driver:
            return None
        prompts = request_inputs.batch_of_token_ids(inputs, "add_requests")
        max_new_tokens = request_inputs.max_new_tokens(max_new_tokens, "add_requests: max_new_tokens")
        streaming = request_inputs.flag(streaming, "add_requests: streaming")
        record_timestamps = request_inputs.flag(record_timestamps, "add_requests: record_timestamps")
        kwargs = self._checked_processor_kwargs(logit_processor_kwargs, "add_requests")
        eos = self.default_eos_token_id
        states = [
            self._new_state(prompt, None, max_new_tokens, streaming, record_timestamps, eos, kwargs)
            for prompt in prompts
        ]
        with self._requests.lock:
            self._check_accepting()
            for state in states:
                self._requests.register(state)
        request_ids = [state.request_id for state in states]
        ordered = sorted(states, key=lambda s: s.initial_tokens, reverse=True) if self._use_prefix_sharing else states
        for index, state in enumerate(ordered):
            try:
                self._enqueue(state)
            except BaseException:
                with self._requests.lock:
                    for unqueued in ordered[index + 1 :]:
                        self._requests.unregister(unqueued)
                raise
        return request_ids

    def cancel_request(self, request_id: str) -> None:
        """Cancel a request, whether it is queued, waiting or running (a child `req_<n>__child#<i>` too, before or
        after its fork): its blocks are freed and it ends with one CANCELLED output (transformers sends none).
        Cancelling an id that already ended, or never existed, does nothing; so does any cancel on a tensor-parallel
        rank other than the driver (the requests are the driver's). A `request_id` that is not a str raises TypeError
        (on every rank): no request can have it, so it is a mistake in the caller's code."""
        request_id = request_inputs.known_request_id(request_id, "cancel_request: request_id")
        if not self.is_tp_driver:
            return
        with self._requests.lock:
            marked = self._requests.mark_cancelled_if_queued(request_id)
        if not marked:
            self.cancel_queue.put(request_id)
        self._wake_up_loop.set()

    def grammar_engine(self) -> GrammarEngine:
        """The grammar engine of structured output for this model's tokenizer (cbcore/grammar.py), made on first
        use; ValueError when there is no tokenizer to make it from."""
        if self._grammar_engine is None:
            if self.tokenizer is None:
                self.tokenizer = _load_tokenizer(self.model)
            embeddings = self.model.get_output_embeddings()
            vocab_size = (embeddings.weight.shape[0] if embeddings is not None
                          else self.model.get_input_embeddings().num_embeddings)
            eos = self.default_eos_token_id
            stop_ids = tuple(t for t in ([eos] if isinstance(eos, int) else eos or ()) if t >= 0)
            self._grammar_engine = engine_for(self.tokenizer, vocab_size, stop_ids)
        return self._grammar_engine

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
        """A request not yet queued; an automatic id is given when it is registered. `kwargs` were checked by
        `request_inputs.processor_kwargs`: the sampling controls and `prompt_logprobs` are split out of them."""
        if max_new_tokens is None:
            max_new_tokens = self.generation_config.max_new_tokens
        kwargs = dict(kwargs)
        controls = {name: kwargs.pop(name) for name in CONTROL_KWARGS if name in kwargs}
        prompt_logprobs = kwargs.pop(PROMPT_LOGPROBS_KWARG, None)
        constraint = kwargs.pop(STRUCTURED_OUTPUT_KWARG, None)
        min_tokens = controls.get("min_tokens", 0)
        if max_new_tokens is not None and min_tokens > max_new_tokens:
            raise ValueError(f"request {request_id or '(new)'}: min_tokens={min_tokens} is more than "
                             f"max_new_tokens={max_new_tokens}")
        state = RequestState(
            request_id=request_id or "",
            initial_tokens=prompt,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.default_eos_token_id if eos_token_id is None else eos_token_id,
            streaming=streaming,
            record_timestamps=record_timestamps,
            num_children=self.num_return_sequences - 1,
            logit_processor_kwargs=kwargs,
            sampling_controls=controls,
            prompt_logprobs=prompt_logprobs,
        )
        if constraint is not None:
            # Compiled here, on the caller's thread (cached per distinct constraint): the loop never waits on it. A
            # constraint that does not compile fails this request alone, with a FAILED output naming the problem.
            try:
                state.grammar = self.grammar_engine().request_grammar(constraint, state.finish_token_ids)
            except GrammarError as error:
                state.grammar_problem = str(error)
        return state

    def _check_accepting(self) -> None:
        """Under the registry's lock: raise when requests are not accepted now."""
        if self._requests.closed_reason is not None:
            fatal = self.background_thread_status.fatal_error
            raise RuntimeError(f"cannot add a request: {self._requests.closed_reason}") from fatal

    def _enqueue(self, state: RequestState) -> None:
        """Put a registered request on the input queue, waiting (bounded) for room. Checked under the same lock as
        `stop()` closes the manager, so a request is either queued before stopping began (and served) or refused."""
        deadline = time.monotonic() + ADD_REQUEST_TIMEOUT_S
        while True:
            with self._requests.lock:
                try:
                    self._check_accepting()
                    self.input_queue.put_nowait(state)
                except queue.Full:
                    pass
                except BaseException:
                    self._requests.unregister(state)
                    raise
                else:
                    self._requests.mark_queued(state)
                    self._wake_up_loop.set()
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                with self._requests.lock:
                    self._requests.unregister(state)
                raise queue.Full(f"request {state.request_id}: the input queue is full (max_queue_size)")
            with self.input_queue.not_full:
                self.input_queue.not_full.wait(timeout=min(remaining, 0.05))


def _load_tokenizer(model: torch.nn.Module) -> Any:
    """The tokenizer saved with `model` (its `name_or_path`, local files only), for structured output."""
    from transformers import AutoTokenizer

    source = getattr(model, "name_or_path", "") or ""
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(
            f"structured_output needs the model's tokenizer, and none loads from the model's name_or_path "
            f"{source!r} ({type(error).__name__}); pass it: ContinuousBatchingManager(..., tokenizer=tokenizer)"
        ) from None
