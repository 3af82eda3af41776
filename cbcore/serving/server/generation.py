"""One HTTP request's lifecycle on the manager: its choices added, their snapshots turned into text, stopped, ended.

A request is `len(prompts) * n` choices; each is one manager request (id `<response id>-<choice index>`), always
added with `streaming=True` so that stop strings are seen as soon as they are generated and latencies can be
measured. Its outputs reach the asyncio loop through `register_result_handler`: `add_request` and the handler's
registration happen on the loop thread with no await between them, and anything the engine delivered in that
instant (it went to the manager's shared output queue, no handler being registered yet) is drained with
`get_result(request_id, timeout=0)` before any handler call can run, so no output is lost or reordered and none is
left behind in the manager's queue.

A choice ends when its terminal output arrives (FINISHED: `finish_reason` "stop" on EOS, "length" at max_tokens),
or as soon as a stop string appears in its text: the request is then cancelled in the engine at once (its blocks are
freed) and its later outputs are ignored. `cancel()` (client disconnected) cancels every choice not yet ended.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from cbcore.requests import GenerationOutput, RequestStatus

from .detokenizer import IncrementalDetokenizer, StopMatcher
from .metrics import ServerMetrics
from .protocol import ProtocolError, SamplingParams
from .tools import ToolCall, ToolCallExtractor, ToolRequest

# How often a wait for outputs checks that the engine loop is still alive (the loop fails every pending request when
# it dies, so this is a second line of defence against a wait that could never end).
_LIVENESS_POLL_S = 1.0


class EngineUnavailable(Exception):
    """The engine loop is not running (stopping, or it died): answered 503."""


@dataclass
class Delta:
    """New output of one choice: text safe to send, the tokens it accounts for (and their logprobs), and, on its
    last delta, why it ended. `error` is set when the engine failed the choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # Per token, the (token ids, logprobs) of the step's most likely tokens (`top_logprobs` > 0).
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    # With tools (tools.py): reasoning the response template split out, and tool calls completed in this delta.
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class _Choice:
    """The server's view of one manager request."""

    def __init__(self, index: int, request_id: str, prompt_index: int, prompt_len: int, tokenizer: Any,
                 stops: list[str]) -> None:
        self.index = index
        self.request_id = request_id
        self.prompt_index = prompt_index
        self.prompt_len = prompt_len
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = StopMatcher(stops)
        self.done = False
        self.started = False  # first token seen
        self.num_tokens = 0  # generated tokens accounted for (usage)
        self.tokens_sent = 0  # tokens whose logprobs went out in a delta
        self.echoed = False  # the prompt went out (echo)
        self.added_at = time.perf_counter()
        self.last_token_at = self.added_at
        # With tools: the text split into content and calls, and (tool_choice auto) the text with special tokens.
        self.tool_calls: ToolCallExtractor | None = None
        self.raw_detokenizer: IncrementalDetokenizer | None = None


class Generation:
    """The choices of one HTTP request on the manager."""

    def __init__(self, manager: Any, tokenizer: Any, metrics: ServerMetrics, response_id: str,
                 prompts: list[list[int]], params: SamplingParams, eos_token_ids: set[int],
                 tools: ToolRequest | None = None, response_template: dict | None = None) -> None:
        """`tools`: the chat request's tools (not "none"), whose calls each choice's text is parsed for;
        `response_template`: transformers' template that parses them for tool_choice "auto"."""
        self.manager = manager
        self.tools = tools
        self.response_template = response_template
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.response_id = response_id
        self.prompts = prompts
        self.params = params
        # What ends a choice with finish_reason "stop" (else "length"): EOS unless ignore_eos, and stop_token_ids.
        controls = params.controls
        self.finish_token_ids = set(controls.get("stop_token_ids", ())) | (
            set() if controls.get("ignore_eos") else eos_token_ids)
        self.choices: list[_Choice] = []
        self._events: asyncio.Queue[tuple[_Choice, GenerationOutput] | None] = asyncio.Queue()
        self.prompt_tokens = sum(len(p) for p in prompts)

    # ----------------------------------------------------------------------------------------------- adding ----

    def start(self) -> None:
        """Add every choice (synchronously, on the loop thread). On any refusal the choices already added are
        cancelled and the error is raised: ProtocolError (400 / 429) or EngineUnavailable (503)."""
        kwargs = self.params.engine_kwargs()
        try:
            for prompt_index, prompt in enumerate(self.prompts):
                for k in range(self.params.n):
                    index = prompt_index * self.params.n + k
                    choice = _Choice(index, f"{self.response_id}-{index}", prompt_index, len(prompt),
                                     self.tokenizer, self.params.stop)
                    if self.tools is not None:
                        prefix = self.tokenizer.decode(prompt, skip_special_tokens=False)
                        choice.tool_calls = ToolCallExtractor(self.tools, self.response_template, prefix)
                        if self.tools.choice == "auto":
                            choice.raw_detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=False)
                    seeded = kwargs if self.params.seed is None else {**kwargs, "seed": self.params.seed + k}
                    self._add(choice, prompt, seeded)
        except BaseException:
            self.cancel()
            raise
        self.metrics.prompt_tokens.inc(self.prompt_tokens)

    def _add(self, choice: _Choice, prompt: list[int], kwargs: dict[str, Any]) -> None:
        import queue

        try:
            self.manager.add_request(prompt, request_id=choice.request_id, max_new_tokens=self.params.max_tokens,
                                     streaming=True, **kwargs)
        except queue.Full as error:
            raise ProtocolError("the server's queue is full; retry later", code="rate_limit_exceeded",
                                status_code=429, error_type="rate_limit_error") from error
        except (TypeError, ValueError) as error:
            raise ProtocolError(str(error)) from error
        except RuntimeError as error:
            raise EngineUnavailable(str(error)) from error
        self.choices.append(choice)
        self.metrics.choice_added()

        def handler(output: GenerationOutput, choice: _Choice = choice) -> None:
            self._events.put_nowait((choice, output))

        self.manager.register_result_handler(choice.request_id, handler)
        # Outputs delivered before the handler existed went to the manager's shared queue: take them now, in order.
        while (early := self.manager.get_result(choice.request_id, timeout=0)) is not None:
            handler(early)

    # -------------------------------------------------------------------------------------------- consuming ----

    def cancel(self) -> None:
        """Cancel every choice not yet ended (a client that went away): the engine frees their blocks at once."""
        if self.finished:
            return
        for choice in self.choices:
            if not choice.done:
                self._end(choice)
                self.manager.cancel_request(choice.request_id)
        self._events.put_nowait(None)  # wakes `deltas()`, which then sees every choice ended

    def _end(self, choice: _Choice) -> None:
        choice.done = True
        self.metrics.choice_ended(choice.started)

    @property
    def finished(self) -> bool:
        """Whether every choice has ended."""
        return all(choice.done for choice in self.choices)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yield deltas of every choice, interleaved as the engine produces them, until every choice has ended.
        Raises EngineUnavailable if the engine loop stops while choices are pending."""
        while not self.finished:
            try:
                event = await asyncio.wait_for(self._events.get(), timeout=_LIVENESS_POLL_S)
            except asyncio.TimeoutError:
                if not self.manager.is_running():
                    fatal = self.manager.background_thread_status.fatal_error
                    raise EngineUnavailable(f"the engine loop stopped ({fatal!r})") from None
                continue
            if event is None:
                continue
            choice, output = event
            if choice.done:
                continue  # outputs after a stop string cancelled it, or after a disconnect
            delta = self._advance(choice, output)
            if delta is not None:
                yield delta

    def _advance(self, choice: _Choice, output: GenerationOutput) -> Delta | None:
        # Scoring alone (max_tokens 0): the one token the prompt's last row yields is dropped.
        tokens = [] if self.params.score_only else output.generated_tokens
        self._observe_latency(choice, len(tokens))
        if output.status == RequestStatus.FAILED or output.status == RequestStatus.CANCELLED:
            self._end(choice)
            reason = output.error or ("cancelled by the engine" if output.status == RequestStatus.CANCELLED else
                                      "failed")
            return Delta(choice.index, error=f"request {choice.request_id}: {reason}")
        finished = output.status == RequestStatus.FINISHED
        text = choice.detokenizer.push(tokens, final=finished)
        choice.stop.feed(text)
        choice.num_tokens = len(tokens)
        finish_reason = None
        if choice.stop.stopped:
            finish_reason = "stop"
            if not finished:
                self.manager.cancel_request(choice.request_id)  # its blocks are freed at the loop's next iteration
        elif finished:
            finish_reason = "stop" if tokens and tokens[-1] in self.finish_token_ids else "length"
        released = choice.stop.release(final=finish_reason is not None)
        if finish_reason is not None:
            self._end(choice)
        if not released and finish_reason is None:
            return None
        delta = Delta(choice.index, released, finish_reason=finish_reason)
        if choice.tool_calls is not None:
            self._extract_tool_calls(choice, delta, tokens, finish_reason is not None)
            if not (delta.text or delta.reasoning or delta.tool_calls or finish_reason or self.params.logprobs):
                return None  # text held back (a call being written): nothing to send yet
        new_tokens = tokens[choice.tokens_sent :]
        new_logprobs = list(output.logprobs[choice.tokens_sent : len(tokens)]) if self.params.logprobs else []
        new_top = list(output.top_logprobs[choice.tokens_sent : len(tokens)]) if self.params.top_logprobs else []
        choice.tokens_sent = len(tokens)
        self.metrics.generated_tokens.inc(len(new_tokens))
        delta.token_ids, delta.logprobs, delta.top_logprobs = list(new_tokens), new_logprobs, new_top
        if self.params.echo and not choice.echoed:
            self._echo(choice, output, delta)
        return delta

    def _extract_tool_calls(self, choice: _Choice, delta: Delta, tokens: list[int], final: bool) -> None:
        """Turn the delta's text into content and tool calls (tools.py): for tool_choice "auto" from the text with
        special tokens kept, else from the grammar's JSON, parsed at the end; a choice that made calls ends with
        finish_reason "tool_calls" ("stop" for a named function)."""
        extractor = choice.tool_calls
        if choice.raw_detokenizer is not None:
            extracted = extractor.feed(choice.raw_detokenizer.push(tokens, final=final))
        else:
            extracted = extractor.feed(delta.text)
        if final:
            last = extractor.finish()
            extracted.content += last.content
            extracted.reasoning += last.reasoning
            extracted.calls += last.calls
        delta.text, delta.reasoning, delta.tool_calls = extracted.content, extracted.reasoning, extracted.calls
        if final and extractor.made_calls and delta.finish_reason == "stop":
            delta.finish_reason = self.tools.finish_reason

    def _echo(self, choice: _Choice, output: GenerationOutput, delta: Delta) -> None:
        """Put the prompt before the choice's first delta: its text, and with logprobs its tokens with their
        logprobs under the model (the first token has none: null, as OpenAI's and vLLM's echo)."""
        choice.echoed = True
        prompt = self.prompts[choice.prompt_index]
        delta.text = self.tokenizer.decode(prompt, skip_special_tokens=True) + delta.text
        if not self.params.logprobs:
            return
        scored = output.prompt_logprobs
        if scored is None:  # cannot happen: the engine ends prefill (and scoring) before any output with tokens
            raise RuntimeError(f"request {choice.request_id}: echo with logprobs, but no prompt logprobs came back")
        delta.token_ids = list(prompt) + delta.token_ids
        delta.logprobs = list(scored.token_logprobs) + delta.logprobs
        if self.params.top_logprobs:
            delta.top_logprobs = list(scored.top_logprobs) + delta.top_logprobs

    def _observe_latency(self, choice: _Choice, num_tokens: int) -> None:
        new = num_tokens - choice.num_tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if not choice.started:
            choice.started = True
            self.metrics.ttft.observe(now - choice.added_at)
            self.metrics.choice_started()
            new -= 1
        if new > 0:
            gap = (now - choice.last_token_at) / new
            for _ in range(new):
                self.metrics.itl.observe(gap)
        choice.last_token_at = now

    def usage(self) -> dict[str, int]:
        """OpenAI's usage counts: the prompt once, every choice's generated tokens."""
        completion = sum(choice.num_tokens for choice in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}
