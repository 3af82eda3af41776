"""The FastAPI app: routes, API-key check, backpressure, engine liveness, and the two generation endpoints.

| route | |
|---|---|
| `POST /v1/completions` | prompt as text, list of texts, token ids or list of token-id lists |
| `POST /v1/chat/completions` | messages through the tokenizer's chat template |
| `GET /v1/models` | the one model served |
| `GET /health` | 200 while the engine loop runs, else 503 (never needs the API key) |
| `GET /metrics` | Prometheus text format (`metrics.py`) |

Errors are OpenAI's error body: 400 invalid request, 401 bad or missing API key, 404 unknown model or route, 429
queue full (with `Retry-After`), 500 a request the engine failed, 503 the engine loop is not running. When the loop
dies, every later request is answered 503 and `on_engine_death` is called (the launcher stops uvicorn and exits
non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...sampling_controls import token_problem
from .constraints import constrain
from .generation import EngineUnavailable, Generation
from .metrics import ServerMetrics
from .protocol import ProtocolError, SamplingParams, parse_chat, parse_completion
from .responses import ChoiceText, ResponseBuilder, sse
from .prompts import apply_chat_template, bad_word_ids, encode_text, fit
from .rollout_routes import add_rollout_routes
from .tools import ToolRequest, parse_tools, parser_template

logger = logging.getLogger("cbcore.serve")

RETRY_AFTER_S = 1  # what a 429 tells the client to wait
_WATCHDOG_PERIOD_S = 0.5


@dataclass
class ServerState:
    """What the routes share: the one manager and tokenizer, and the serving limits."""

    manager: Any
    tokenizer: Any
    model_name: str
    max_context: int  # prompt + generated tokens one request may reach (position table and cache)
    vocab_size: int
    max_queue_size: int  # choices waiting for their first token; 0: unbounded
    api_key: str | None = None
    on_engine_death: Callable[[str], None] | None = None
    logprobs_mode: str = "raw"  # a request's unless it sends its own (--logprobs-mode)
    rollout_routes: bool = False  # --enable-rollout-routes (cbcore/serving/server/rollout_routes.py)
    sleeping: bool = False  # between /sleep and /wake_up: the engine is freed on purpose, not dead
    dead_reason: str | None = None
    stopping: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def eos_token_ids(self) -> set[int]:
        """The manager's default EOS ids (a finish_reason of "stop" when one ends a choice)."""
        eos = self.manager.default_eos_token_id
        return {t for t in ([eos] if isinstance(eos, int) else eos) if t >= 0}


def _error(status: int, message: str, error_type: str, code: str | None = None, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(state: ServerState) -> FastAPI:
    """The app over `state.manager`, which must already be started."""
    metrics = ServerMetrics(state.manager)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        watchdog = asyncio.create_task(_watch_engine(state))
        try:
            yield
        finally:
            state.stopping = True
            watchdog.cancel()

    app = FastAPI(title="cbcore", lifespan=lifespan)
    app.state.server = state
    app.state.metrics = metrics

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if state.api_key is not None and request.url.path != "/health":
            header = request.headers.get("authorization", "")
            scheme, _, key = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
                metrics.count(_endpoint(request), "unauthorized")
                return _error(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                              "invalid_request_error", code="invalid_api_key")
        return await call_next(request)

    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, error: ProtocolError):
        outcome = "rejected" if error.status_code == 429 else "invalid"
        metrics.count(_endpoint(request), outcome)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status_code == 429 else None
        return JSONResponse(error.body(), status_code=error.status_code, headers=headers)

    @app.exception_handler(EngineUnavailable)
    async def engine_unavailable(request: Request, error: EngineUnavailable):
        metrics.count(_endpoint(request), "failed")
        return _error(503, f"the engine is not serving: {error}", "server_error", code="engine_unavailable")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return _error(error.status_code, str(error.detail), "invalid_request_error",
                      code="not_found" if error.status_code == 404 else None)

    @app.get("/health")
    async def health():
        if state.sleeping:
            return {"status": "sleeping"}
        if state.dead_reason is not None or not state.manager.is_running():
            return _error(503, f"the engine is not serving: {state.dead_reason or 'stopped'}", "server_error",
                          code="engine_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "cbcore",
             "max_model_len": state.max_context},
        ]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        parsed = parse_completion(body)
        _check_model(state, parsed.model)
        constrain(state.manager, parsed.params, body)
        prompts = [encode_text(state.tokenizer, p) if isinstance(p, str) else p for p in parsed.prompts]
        return await _serve(request, state, metrics, "completion", prompts, parsed.params, parsed.stream,
                            parsed.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json(request)
        parsed = parse_chat(body)
        _check_model(state, parsed.model)
        tools = parse_tools(body)
        constrain(state.manager, parsed.params, body, tools)
        auto = tools is not None and tools.choice == "auto"
        template = parser_template(state.tokenizer, state.manager.model) if auto else None
        prompt = apply_chat_template(state.tokenizer, parsed.messages, tools.tools if tools is not None else None)
        return await _serve(request, state, metrics, "chat", [prompt], parsed.params, parsed.stream,
                            parsed.include_usage, tools if tools is not None and tools.choice != "none" else None,
                            template)

    if state.rollout_routes:
        add_rollout_routes(app, state)
    return app


# -------------------------------------------------------------------------------------------------- helpers

_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/health")


def _endpoint(request: Request) -> str:
    """The metrics label of a request's path: one of the routes, else "other" (a label per unknown path would let
    any client grow the metrics without bound)."""
    path = request.url.path
    return path if path in _ENDPOINTS else "other"


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ProtocolError(f"the request body is not valid JSON: {error}", code="invalid_json") from error


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ProtocolError(f"The model '{model}' does not exist; this server serves '{state.model_name}'",
                            param="model", code="model_not_found", status_code=404)


def _check_capacity(state: ServerState, generation_size: int, waiting: float) -> None:
    if state.sleeping:
        raise EngineUnavailable("the engine is asleep (POST /sleep); POST /wake_up first")
    if state.dead_reason is not None or state.stopping or not state.manager.is_running():
        raise EngineUnavailable(state.dead_reason or "the server is shutting down")
    if state.max_queue_size <= 0:
        return
    if generation_size > state.max_queue_size:
        raise ProtocolError(f"this request needs {generation_size} choices but the queue holds at most "
                            f"{state.max_queue_size} (--max-queue-size)", param="n", code="invalid_value")
    if waiting + generation_size > state.max_queue_size:
        raise ProtocolError(f"the queue is full ({int(waiting)} requests waiting, --max-queue-size "
                            f"{state.max_queue_size}); retry after {RETRY_AFTER_S} s", code="rate_limit_exceeded",
                            status_code=429, error_type="rate_limit_error")


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _serve(request: Request, state: ServerState, metrics: ServerMetrics, kind: str,
                 prompts: list[list[int]], params: SamplingParams, stream: bool, include_usage: bool,
                 tools: ToolRequest | None = None, response_template: dict | None = None):
    params = fit(prompts, params, state.vocab_size, state.max_context)
    if params.bad_words:
        params.controls["bad_words_ids"] = bad_word_ids(state.tokenizer, params.bad_words)
    problem = token_problem(params.controls, state.vocab_size)
    if problem is not None:
        raise ProtocolError(problem, param=problem.split()[0], code="invalid_value")
    if params.logprobs_mode is None and state.logprobs_mode != "raw":
        params.logprobs_mode = state.logprobs_mode
    # Requests still in the manager's input queue count too (a cancelled one stays there until the loop takes it):
    # with room for all of this request's choices, add_request never waits on a full queue, which would block the
    # event loop.
    _check_capacity(state, len(prompts) * params.n, max(metrics.num_waiting, state.manager.input_queue.qsize()))
    builder = ResponseBuilder(kind, state.model_name, state.tokenizer, params.logprobs, include_usage,
                              params.tokens_as_ids)
    generation = Generation(state.manager, state.tokenizer, metrics, builder.id, prompts, params,
                            state.eos_token_ids, tools, response_template)
    generation.start()
    endpoint = _endpoint(request)
    if stream:
        # The background task runs once the response ends, disconnects included: a client gone before the stream's
        # first chunk (the generator then never starts, so its `finally` never runs) still has its choices cancelled.
        return StreamingResponse(_stream(request, generation, builder, metrics, endpoint, kind),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(generation.cancel))
    collected = asyncio.ensure_future(_collect(generation))
    disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collected, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
        if not collected.done():  # the client went away (or this handler was cancelled): stop its choices now
            collected.cancel()
            generation.cancel()
            metrics.count(endpoint, "cancelled")
    if not collected.done():
        return Response(status_code=499)
    choices = collected.result()  # raises EngineUnavailable
    failed = [c for c in choices if isinstance(c, str)]
    if failed:
        metrics.count(endpoint, "failed")
        return _error(500, failed[0], "server_error", code="generation_failed")
    metrics.count(endpoint, "success")
    return builder.response(choices, generation.usage())


async def _collect(generation: Generation) -> list[ChoiceText | str]:
    """Every choice's whole output (a str: the error that ended it)."""
    results: list[ChoiceText | str] = [ChoiceText(choice.index) for choice in generation.choices]
    async for delta in generation.deltas():
        if delta.error is not None:
            results[delta.index] = delta.error
            continue
        result = results[delta.index]
        if isinstance(result, str):
            continue
        result.text += delta.text
        result.token_ids += delta.token_ids
        result.logprobs += delta.logprobs
        result.top_logprobs += delta.top_logprobs
        result.reasoning += delta.reasoning
        result.tool_calls += delta.tool_calls
        result.finish_reason = delta.finish_reason or result.finish_reason
    return results


async def _stream(request: Request, generation: Generation, builder: ResponseBuilder, metrics: ServerMetrics,
                  endpoint: str, kind: str):
    """SSE events: (chat) a role chunk per choice, text deltas, each choice's finish chunk, the usage chunk when
    asked, `data: [DONE]`. A client that goes away cancels the choices still running (Starlette cancels this
    generator when it sees the disconnect; the watcher covers servers that do not tell it)."""
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    watcher.add_done_callback(lambda task: task.cancelled() or generation.cancel())
    offsets = [0] * len(generation.choices)
    calls_sent = [0] * len(generation.choices)  # per choice, its tool calls streamed so far (their delta index)
    outcome = "cancelled"
    try:
        if kind == "chat":
            for choice in generation.choices:
                yield sse(builder.role_chunk(choice.index))
        try:
            async for delta in generation.deltas():
                if delta.error is not None:
                    outcome = "failed"
                    yield sse({"error": {"message": delta.error, "type": "server_error", "param": None,
                                         "code": "generation_failed"}})
                    continue
                first = calls_sent[delta.index]
                calls = list(enumerate(delta.tool_calls, start=first))
                calls_sent[delta.index] += len(calls)
                yield sse(builder.delta_chunk(delta.index, delta.text, delta.token_ids, delta.logprobs,
                                              delta.finish_reason, offsets[delta.index], delta.top_logprobs,
                                              delta.reasoning, calls))
                offsets[delta.index] += len(delta.text)
        except EngineUnavailable as error:
            outcome = "failed"
            yield sse({"error": {"message": f"the engine is not serving: {error}", "type": "server_error",
                                 "param": None, "code": "engine_unavailable"}})
        if watcher.done():
            return  # the client is gone: nothing more to send
        if builder.include_usage:
            yield sse(builder.usage_chunk(generation.usage()))
        yield sse("[DONE]")
        if outcome == "cancelled":
            outcome = "success"
    finally:
        watcher.cancel()
        if not generation.finished:
            generation.cancel()
        metrics.count(endpoint, outcome)


async def _watch_engine(state: ServerState) -> None:
    """Notice the engine loop's death: answer 503 from then on and let the launcher exit non-zero."""
    while True:
        await asyncio.sleep(_WATCHDOG_PERIOD_S)
        if state.stopping or state.dead_reason is not None or state.sleeping:
            continue
        if not state.manager.is_running():
            fatal = state.manager.background_thread_status.fatal_error
            state.dead_reason = f"the engine loop died ({type(fatal).__name__}: {fatal})" if fatal else \
                "the engine loop stopped"
            logger.error("cbcore serve: %s; answering 503 and shutting down", state.dead_reason)
            if state.on_engine_death is not None:
                state.on_engine_death(state.dead_reason)
