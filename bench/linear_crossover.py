"""Skinny matmul against oneDNN's packed matmul on one decode step's linears, by rows: where each should run.

    python bench/linear_crossover.py [--dtype float32] [--model w2|w4] [--rows 1,8,16,32,64,128,512]

A "step" is every linear of the model once, each layer with its own weights (W2's random Llama: 8 layers of
512->1024 qkv, 512->512 o, 512->2816 gate/up, 1408->512 down, then the 512->8192 head; W4's SmolLM2-135M: 30 layers
of 576->960, 576->576, 576->3072, 1536->576 and the 576->49152 head), so the weights stream from memory as in a real
step instead of staying in cache. Both matmuls run the same step alternately, 7 rounds; the table gives medians.
Appends to `bench/results/linear_crossover_<cpu>.md` (the CPU named by `--cpu-name`, default from /proc/cpuinfo)
the command and the table. `cbcore.linear_backends.linear_backends` takes its row limits from these runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from cbcore import _C
from cbcore.benchmarks.models import RANDOM_LLAMA


def llama_shapes(config: dict) -> tuple[int, list[tuple[int, int]], tuple[int, int]]:
    """(layers, [(in, out)] of a layer's merged q/k/v, o, merged gate/up and down projections, the head's (in, out))
    of a Llama-shaped config, as cbcore packs them (cbcore/linear.py merges q/k/v and gate/up)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    qkv = hidden + 2 * config["num_key_value_heads"] * head_dim
    projections = [(hidden, qkv), (hidden, hidden), (hidden, 2 * inter), (inter, hidden)]
    return config["num_hidden_layers"], projections, (hidden, config["vocab_size"])


SHAPES = {
    "w2": llama_shapes(RANDOM_LLAMA),
    # SmolLM2-135M-Instruct (W4's default model, shipped as GGUF: its config is not at hand without converting it).
    "w4": llama_shapes(dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                            num_hidden_layers=30, vocab_size=49152)),
}


def cpu_name() -> str:
    """The CPU's model name, for the results file."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model", default="w2", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,8,16,32,64,128,512")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True, help="the markdown file to append to")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    dtype = getattr(torch, args.dtype)
    layers, shapes, head = SHAPES[args.model]
    torch.manual_seed(0)
    weights = [torch.randn(n, k).to(dtype) for _ in range(layers) for (k, n) in shapes]
    weights.append(torch.randn(head[1], head[0]).to(dtype))
    panels = [_C.skinny_pack(w) for w in weights]
    blocked = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]

    def skinny(x: torch.Tensor, i: int) -> torch.Tensor:
        return _C.skinny_matmul(x, panels[i], weights[i].shape[0])

    def onednn(x: torch.Tensor, i: int) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, blocked[i], None, "none", [], None)

    lines = [f"\n`python bench/linear_crossover.py --dtype {args.dtype} --model {args.model} --rows {args.rows}` "
             f"({cpu_name()}, 2 threads, skinny ISA {_C.skinny_isa(dtype)}, torch {torch.__version__})\n",
             "| rows | skinny ms | skinny GFLOP/s | oneDNN ms | oneDNN GFLOP/s | skinny / oneDNN time |",
             "|---:|---:|---:|---:|---:|---:|"]
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k).to(dtype) for k in {w.shape[1] for w in weights}}
        times: dict[str, list[float]] = {"skinny": [], "onednn": []}
        for _ in range(args.rounds):
            for name, matmul in (("skinny", skinny), ("onednn", onednn)):
                start = time.perf_counter()
                for i, w in enumerate(weights):
                    matmul(inputs[w.shape[1]], i)
                times[name].append(time.perf_counter() - start)
        sk, dn = statistics.median(times["skinny"]), statistics.median(times["onednn"])
        flop = 2 * rows * sum(w.numel() for w in weights)
        lines.append(f"| {rows} | {sk * 1e3:.2f} | {flop / sk / 1e9:.0f} | {dn * 1e3:.2f} | {flop / dn / 1e9:.0f} | "
                     f"{sk / dn:.2f} |")
        print(lines[-1], flush=True)
    with args.out.open("a") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
