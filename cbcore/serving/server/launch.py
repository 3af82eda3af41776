"""`python -m cbcore serve`: load the model, build and start the one manager, run uvicorn, stop cleanly.

The manager is configured for serving: `per_request_processors=True` (each request's temperature / top_p / top_k),
`return_logprobs=True`, `max_queue_size` from `--max-queue-size`, and a sampling generation config with OpenAI's
defaults (temperature 1, top_p 1, no top_k). The model's own generation config gives EOS, BOS and pad only: its
sampling settings, if any, are not applied (OpenAI's defaults are). Greedy requests (temperature 0) run as top_k=1.

Shutdown: uvicorn handles SIGINT / SIGTERM (stops accepting, waits up to `--shutdown-timeout` for the requests in
flight, cancels what is left); then the manager is stopped, hard if anything still runs, and the exit status is 0.
If the engine loop dies, requests are answered 503, uvicorn is asked to exit, and the exit status is 1.

Under `torchrun --nproc-per-node N` (tensor parallelism) every rank loads its shard and builds the manager; the
server runs on the driver (rank 0) only, and the other ranks run its steps until it stops.
"""

from __future__ import annotations

import argparse
import signal
import time
from typing import Any, TextIO

from cbcore.cli.options import UsageError, build_cb_config

EXIT_OK, EXIT_ENGINE_DIED, EXIT_USAGE = 0, 1, 2


def serving_generation_config(model: Any):
    """Sampling with OpenAI's defaults; the model's special tokens."""
    from transformers import GenerationConfig

    own = model.generation_config
    return GenerationConfig(
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16,
        eos_token_id=own.eos_token_id, bos_token_id=own.bos_token_id, pad_token_id=own.pad_token_id,
    )


def build_manager(model: Any, args: argparse.Namespace, tokenizer: Any = None):
    """The server's manager (not started); `tokenizer` compiles its requests' structured output."""
    from cbcore.serving.manager import ContinuousBatchingManager

    if args.max_queue_size < 0:
        raise UsageError(f"--max-queue-size must be >= 0, got {args.max_queue_size}")
    cb_config = build_cb_config(args, per_request_processors=True, return_logprobs=True,
                                max_queue_size=args.max_queue_size)
    try:
        manager = ContinuousBatchingManager(model, serving_generation_config(model), cb_config, tokenizer=tokenizer)
    except (ValueError, NotImplementedError) as error:
        raise UsageError(f"cannot serve this model: {error}") from error
    return manager


def max_context(model: Any, manager: Any) -> int:
    """The most tokens (prompt + generated) one request may reach: the position table and the whole cache."""
    cfg = manager.continuous_batching_config
    limits = [cfg.num_blocks * cfg.page_size]
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        limits.append(positions)
    return min(limits)


def serve(args: argparse.Namespace, stderr: TextIO) -> int:
    """`python -m cbcore serve`: load the model, build the manager, run uvicorn until a signal; the exit status."""
    import torch
    import uvicorn
    from transformers.utils import logging as hf_logging

    from cbcore.default_model import DEFAULT_MODEL_NAME, ModelLoadError, load_model_and_tokenizer
    from cbcore.distributed.launch import serve_follower, tensor_parallel_load_kwargs, torchrun_world_size

    from .app import ServerState, create_app

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    try:
        # Under torchrun every rank loads its shard of the model (cbcore/distributed/launch.py).
        sharding = tensor_parallel_load_kwargs(args.device) if torchrun_world_size() > 1 else None
        model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype, device=device, sharding=sharding)
    except (ModelLoadError, OSError, ValueError) as error:
        raise UsageError(f"cannot load the model: {error}") from error
    if tokenizer is None:
        raise UsageError(f"--model {args.model}: the folder has no tokenizer; the server needs one to read and "
                         "write text")
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    print(f"cbcore serve: loaded {name} in {time.perf_counter() - started:.1f} s ({args.dtype}, {device})",
          file=stderr, flush=True)

    manager = build_manager(model, args, tokenizer)
    try:
        manager.start()
    except (ValueError, NotImplementedError, RuntimeError) as error:
        raise UsageError(f"cannot serve this model: {error}") from error
    if not manager.is_tp_driver:
        return serve_follower(manager)  # the HTTP server is the driver's; this rank runs its steps
    if manager.compile_seconds:
        print(f"cbcore serve: compiled the step in {manager.compile_seconds:.1f} s", file=stderr, flush=True)
    exit_code = EXIT_OK
    server: uvicorn.Server | None = None
    previous_handlers: dict[int, Any] = {}

    def on_engine_death(reason: str) -> None:
        nonlocal exit_code
        exit_code = EXIT_ENGINE_DIED
        if server is not None:
            server.should_exit = True

    try:
        state = ServerState(
            manager=manager, tokenizer=tokenizer, model_name=name, max_context=max_context(model, manager),
            vocab_size=int(model.get_output_embeddings().weight.shape[0]), max_queue_size=args.max_queue_size,
            api_key=args.api_key, on_engine_death=on_engine_death,
            logprobs_mode=getattr(args, "logprobs_mode", "raw"),
            rollout_routes=getattr(args, "enable_rollout_routes", False),
        )
        app = create_app(state)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
        server = uvicorn.Server(config)
        print(f"cbcore serve: http://{args.host}:{args.port}/v1 (model '{name}')", file=stderr, flush=True)
        # uvicorn handles SIGINT / SIGTERM while it runs, then re-raises the signal it caught once it has restored the
        # handlers it found, which would kill the process by that signal before the manager is stopped. Handlers
        # that do nothing make that re-raise harmless, so the shutdown below runs and the exit status is ours.
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous_handlers[sig] = signal.signal(sig, lambda *_: None)
        server.run()
        if exit_code == EXIT_OK and server.started is False:
            exit_code = EXIT_ENGINE_DIED  # uvicorn could not start (port in use, ...): it logged why
    finally:
        # uvicorn has waited for (or cancelled) the requests in flight; whatever the engine still holds is ended.
        if manager.is_running():
            manager.stop(block=True, timeout=max(args.shutdown_timeout, 1.0))
        if manager.is_running():
            manager.stop(block=True, timeout=10.0, hard_stop=True)
        if manager.background_thread_status.fatal_error is not None:
            exit_code = EXIT_ENGINE_DIED
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
    return exit_code
