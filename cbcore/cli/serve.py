"""`python -m cbcore serve`: its options, then the OpenAI-compatible HTTP server (`cbcore.serving.server.launch`, which
needs the `serve` extra)."""

from __future__ import annotations

import argparse
from typing import TextIO

from .options import UsageError, add_engine_arguments, add_model_arguments


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `serve` and its options under `commands`."""
    p = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible HTTP server (FastAPI + uvicorn) over one continuous-batching manager: "
        "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.",
    )
    add_model_arguments(p)
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None,
                     help="the model name clients send and /v1/models lists (default: --model, or the default model's)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: none)")
    srv.add_argument("--max-queue-size", type=int, default=1024,
                     help="requests (choices) waiting for their first token before new ones are answered 429 "
                     "(0: unbounded; default 1024)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds SIGINT/SIGTERM waits for requests in flight before cancelling them (default 30)")
    srv.add_argument("--seed", type=int, help="seed of the engine's one sampling generator (server-wide)")
    srv.add_argument("--logprobs-mode", default="raw", choices=("raw", "processed"),
                     help="logprobs a request gets unless it sends 'logprobs_mode': raw (the model's own, as OpenAI "
                     "and vLLM report them) or processed (of the distribution sampled from, after penalties, "
                     "temperature and truncation); default raw")
    srv.add_argument("--enable-rollout-routes", action="store_true",
                     help="serve the routes an RL trainer calls between rollout phases (vLLM's /pause, /resume, "
                     "/update_weights, /init_weight_transfer_engine, /reset_prefix_cache, /sleep, /wake_up; SGLang's "
                     "/update_weights_from_disk); off by default, behind --api-key like every route")
    srv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_engine_arguments(p)
    p.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """Hand the arguments to `cbcore.serving.server.launch` (imported only now: it needs the `serve` extra)."""
    try:
        from cbcore.serving.server import launch
    except ImportError as error:
        raise UsageError(f"serve needs fastapi, uvicorn and prometheus_client ({error}); install them with "
                         "`pip install fastapi uvicorn prometheus_client` (or the `serve` extra)") from error
    return launch.serve(args, stderr)
