"""`python -m cbcore bench`: every argument after it, --help included, goes to the side-by-side benchmark's own parser
(`cbcore.benchmarks.side_by_side`)."""

from __future__ import annotations

import argparse
from typing import TextIO


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `bench` under `commands`; everything after it is the benchmark's (see `cbcore.cli.main`)."""
    p = commands.add_parser(
        "bench",
        add_help=False,  # --help goes to the benchmark's own parser
        help="compare cbcore with transformers, model.generate and vLLM on one workload",
    )
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(handler=run_bench)


def run_bench(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """Hand the arguments to `cbcore.benchmarks.side_by_side.main` (imported only now: it pulls in psutil and the
    peers' machinery, which `generate` does not need)."""
    from cbcore.benchmarks import side_by_side

    return side_by_side.main(args.bench_args)
