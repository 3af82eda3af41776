"""How much of a decode step's skinny matmul time is the weights' streaming from memory: W2's step of linears with
every layer's own weights (cold: they come from memory, as in a real step) against the same FLOPs on layer 0's
weights eight times (hot: from the last-level cache after the first layer), by rows.

    python bench/linear_hot_cold.py [--rows 16,32,64] [--rounds 9] [--threads 2]

Prints one line per row count: median ms and GFLOP/s of each, interleaved rounds. Both end with the 512 -> 8192 head,
which no layer shares (cold in both). Why: larger register tiles ran faster from L2 in a probe and not in a step; this
says how far a step's linears are from the kernel's in-cache rate (docs/performance_log.md, 2026-12-05).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.linear_crossover import SHAPES  # noqa: E402
from cbcore import _C  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,32,64")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers, shapes, head = SHAPES["w2"]
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for _ in range(layers) for (k, n) in shapes]
    weights.append(torch.randn(head[1], head[0]))
    panels = [_C.skinny_pack(w) for w in weights]
    per_layer = len(shapes)
    orders = {
        "cold": list(range(len(weights))),
        "hot": [i % per_layer for i in range(len(weights) - 1)] + [len(weights) - 1],
    }
    print(f"W2's linears, fp32, {args.threads} threads, skinny ISA {_C.skinny_isa(torch.float32)}")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        times: dict[str, list[float]] = {name: [] for name in orders}
        for _ in range(args.rounds):
            for name, order in orders.items():
                start = time.perf_counter()
                for i in order:
                    _C.skinny_matmul(inputs[weights[i].shape[1]], panels[i], weights[i].shape[0])
                times[name].append(time.perf_counter() - start)
        parts = []
        for name, order in orders.items():
            median = statistics.median(times[name])
            flop = 2 * rows * sum(weights[i].numel() for i in order)
            parts.append(f"{name} {median * 1e3:.2f} ms {flop / median / 1e9:.0f} GFLOP/s")
        print(f"{rows} rows: " + ", ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
