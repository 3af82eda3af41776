"""What cbcore's commands share: the model and engine options, the `ContinuousBatchingConfig` built from them, and how
a command refuses its input (`UsageError`, the exit statuses)."""

from __future__ import annotations

import argparse
from typing import Any

EXIT_OK, EXIT_FAILED_REQUESTS, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A bad command line, input file or model: printed as `error: ...`, exit status 2."""


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --device."""
    src = p.add_argument_group("model")
    src.add_argument(
        "--model",
        default=None,
        help="a local model folder, a .gguf file, or a hub id already in the local HF cache "
        "(default: the default model, SmolLM2-135M-Instruct)",
    )
    src.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    src.add_argument("--device", default=None, help="where to run (default: cuda if available, else cpu)")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The `ContinuousBatchingConfig` fields a command sets (`build_cb_config` reads them)."""
    eng = p.add_argument_group("engine (cbcore.ContinuousBatchingConfig; default: the engine's own)")
    eng.add_argument("--page-size", type=int, help="tokens per page of the paged KV cache")
    eng.add_argument("--num-blocks", type=int, help="pages in the KV cache (default: sized from free memory)")
    eng.add_argument("--max-batch-tokens", type=int, help="query-token budget of one step")
    eng.add_argument("--scheduler", choices=("fifo", "prefill_first"), help="scheduling policy (default: fifo)")
    eng.add_argument("--no-prefix-sharing", action="store_true", help="turn off prefix caching (block sharing)")
    eng.add_argument("--compile-level", type=int, choices=(0, 1, 2, 3),
                     help="torch.compile the step's forward (default_compile_level): 0 eager, 1 inductor, 2 and 3 "
                     "autotuned (see the README); compiled ahead, and the time it took is printed")


def build_cb_config(args: argparse.Namespace, **overrides: Any):
    """cbcore.ContinuousBatchingConfig with only the fields given on the command line (and `overrides`); the rest
    keep their default."""
    from cbcore.config import ContinuousBatchingConfig

    fields = {
        "page_size": args.page_size,
        "num_blocks": args.num_blocks,
        "max_batch_tokens": args.max_batch_tokens,
        "scheduler_type": args.scheduler,
        "seed": args.seed,
        "default_compile_level": getattr(args, "compile_level", None),
    }
    fields = {k: v for k, v in fields.items() if v is not None}
    if args.no_prefix_sharing:
        fields["allow_block_sharing"] = False
    fields.update(overrides)
    try:
        return ContinuousBatchingConfig(**fields)
    except ValueError as error:
        raise UsageError(f"bad engine settings: {error}") from error
