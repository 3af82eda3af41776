"""The loop thread's OpenMP wake-ups: W3 stepped in the thread that loaded the model, and through `generate_batch`
(the manager's loop thread) with the caller's OpenMP team kept and released (cbcore/openmp_team.py says why).

    python bench/loop_thread_openmp.py [--workload W3] [--dtype float32] [--repeat 3]

Each case runs in a fresh process (OpenMP's teams are process state), the cases interleaved `--repeat` times; the
table gives each case's median generated tok/s (min-max) and its ratio to stepping in the loading thread, which has one
team only and is the ceiling. Writes `bench/results/loop_thread_openmp.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "stepped": "EngineCore.step() in the thread that loaded the model (one OpenMP team)",
    "loop, team kept": "generate_batch: the loop thread, the caller's team kept (CBCORE_RELEASE_OPENMP_TEAM=0)",
    "loop, team released": "generate_batch: the loop thread, the caller's team released before it starts (default)",
}


def run_case(case: str, workload_name: str, dtype_name: str) -> float:
    """Generated tok/s of one case, in this process."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    import cbcore
    from cbcore.benchmarks.models import model_folder
    from cbcore.benchmarks.peers import generation_config
    from cbcore.benchmarks.workloads import build_workload

    torch.set_num_threads(2)
    workload = build_workload(workload_name)
    model = AutoModelForCausalLM.from_pretrained(model_folder(workload.model), dtype=getattr(torch, dtype_name)).eval()
    gen = generation_config(workload)
    with torch.inference_mode():
        if case == "stepped":
            manager = cbcore.ContinuousBatchingManager(model, gen, cbcore.ContinuousBatchingConfig())
            manager.warmup()  # the self-check's forwards: this thread's team exists, as in the other cases
            engine = manager.engine
            engine.binding.attach()
            workload.add_to_engine(engine, manager.default_eos_token_id)
            started = time.perf_counter()
            while engine.has_work():
                engine.step()
            wall = time.perf_counter() - started
            engine.binding.detach()
            generated = engine.stats()["generated_tokens"]
        else:
            cbcore.enable(model)
            model.generate_batch([p[:8] for p in workload.prompts[:2]], gen, max_new_tokens=4)  # warm-up
            started = time.perf_counter()
            outputs = model.generate_batch(workload.prompts, gen)
            wall = time.perf_counter() - started
            generated = sum(len(o.generated_tokens) for o in outputs.values())
    return generated / wall


def main(argv: list[str] | None = None) -> int:
    """Run every case `--repeat` times, interleaved, each in a fresh process, and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="W3", choices=("W1", "W2", "W3"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "loop_thread_openmp.md")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case and print its tok/s
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps({"tok_per_s": run_case(args.case, args.workload, args.dtype)}))
        return 0
    results: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(args.repeat):
        for case in CASES:
            env = {**os.environ, "CBCORE_RELEASE_OPENMP_TEAM": "0" if case == "loop, team kept" else "1"}
            out = subprocess.run([sys.executable, __file__, "--case", case, "--workload", args.workload,
                                  "--dtype", args.dtype], env=env, capture_output=True, text=True, check=True)
            results[case].append(json.loads(out.stdout.strip().splitlines()[-1])["tok_per_s"])
            print(f"{case}: {results[case][-1]:.0f} tok/s", flush=True)
    ceiling = statistics.median(results["stepped"])
    lines = [
        f"# The loop thread's OpenMP wake-ups ({args.workload}, {args.dtype}, 2 torch threads)",
        "",
        f"`python bench/loop_thread_openmp.py --workload {args.workload} --dtype {args.dtype} --repeat {args.repeat}`: "
        f"each case in a fresh process, the cases interleaved, median of {args.repeat} (min-max).",
        "",
        "| case | tok/s | vs stepped |",
        "|---|---:|---:|",
    ]
    for case, description in CASES.items():
        runs = results[case]
        lines.append(f"| {description} | {statistics.median(runs):.0f} ({min(runs):.0f}-{max(runs):.0f}) | "
                     f"{statistics.median(runs) / ceiling:.2f}x |")
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
