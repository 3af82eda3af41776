"""How often the compiled step's greedy tokens diverge from the eager step's, per dtype, on the default model.

In fp32 they must not (tests/test_compiled_step.py checks that compiled tokens equal `model.generate`). In bf16 the
compiled forward fuses norms, RoPE, activations and residual adds into kernels that keep intermediates in fp32 and
sum in another order than eager torch (which rounds to bf16 after every op), so logits differ in their last bits and
a near-tie between the two best tokens can flip; from there the two sequences go their own ways. This script counts
the sequences that differ and where they first do.

    python bench/compiled_divergence.py --dtype bfloat16 --out bench/results/compiled_divergence.md

Runs the W4 chat prompts (the default model, its chat template) to `--max-new-tokens`, eager (level 0) then compiled
(`--level`), each through `generate_batch` after a warm-up call.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--level", type=int, choices=(1, 2, 3), default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="append the result to this Markdown file")
    args = parser.parse_args(argv)

    import cbcore
    from cbcore.benchmarks.workloads import build_workload
    from cbcore.default_model import load_model_and_tokenizer
    from cbcore.benchmarks.peers import generation_config
    from cbcore.compiled_step import compile_seconds

    torch.set_num_threads(args.threads)
    model, _ = load_model_and_tokenizer(None, dtype=args.dtype, device="cpu")
    workload = build_workload("W4", max_new_tokens=args.max_new_tokens)
    gen = generation_config(workload)
    cbcore.enable(model)
    runs: dict[int, tuple[list[list[int]], float]] = {}
    with torch.inference_mode():
        for level in (0, args.level):
            config = cbcore.ContinuousBatchingConfig(default_compile_level=level)
            model.generate_batch([p[:8] for p in workload.prompts[:2]], gen, config, max_new_tokens=4)  # warm-up
            began = time.perf_counter()
            outputs = model.generate_batch(workload.prompts, gen, config)
            wall = time.perf_counter() - began
            runs[level] = ([list(o.generated_tokens) for o in outputs.values()], wall)
    eager, compiled = runs[0][0], runs[args.level][0]
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None if len(x) == len(y) else min(len(x), len(y)))
              for x, y in zip(eager, compiled)]
    diverged = [f for f in firsts if f is not None]
    tokens = sum(len(x) for x in eager)
    lines = [
        f"## {args.dtype}, default_compile_level={args.level}, W4 ({len(eager)} chat prompts), up to "
        f"{args.max_new_tokens} new tokens, greedy",
        "",
        f"`python bench/compiled_divergence.py --dtype {args.dtype} --level {args.level} --max-new-tokens "
        f"{args.max_new_tokens}` on {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} threads.",
        "",
        f"- sequences whose tokens differ from eager: **{len(diverged)} of {len(eager)}**"
        + (f"; first difference at generated token {sorted(diverged)} (positions)" if diverged else ""),
        f"- tokens generated (eager): {tokens}; identical prefix kept on average: "
        f"{sum(f if f is not None else len(x) for f, x in zip(firsts, eager)) / len(eager):.1f} tokens per sequence",
        f"- compile ahead: {compile_seconds(model):.1f} s; wall eager {runs[0][1]:.2f} s, compiled "
        f"{runs[args.level][1]:.2f} s",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        with args.out.open("a", encoding="utf-8") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
