"""Page faults per step: a workload stepped in a thread of its own (as the manager's loop thread steps it), with the
minor page faults and time of every step; with `--compile-level 0` (the eager step, whose attention calls the
kernels from Python) also the cache write's and decode kernel's time per layer.

    python bench/step_page_faults.py [--workload W2] [--dtype float32] [--threads 2] [--compile-level 1]
    MALLOC_ARENA_MAX=1 MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_MMAP_THRESHOLD_=33554432 python bench/step_page_faults.py

Why: every 4 KiB page a step touches for the first time costs a fault and the kernel's zeroing of it, several
microseconds a page on the VMs this project is measured on. Two sources: the activations glibc's malloc maps and unmaps
(blocks over its mmap threshold, and whole heaps of a thread's arena once free), and the KV cache's pages, mapped
lazily (`cbcore.cache.zeroed_pages`) and faulted in by the first token written to them. The glibc variables above
(read when the process starts) keep freed memory mapped; run with and without them to compare. What they gave
(docs/performance_log.md, 2026-12-05): no difference beyond the machine's noise in whole runs, so cbcore does not tune
malloc.
"""

from __future__ import annotations

import argparse
import collections
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.continuous_batching.utils import WorkloadHints

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cbcore  # noqa: E402
from cbcore import ops  # noqa: E402
from cbcore.benchmarks.models import model_folder  # noqa: E402
from cbcore.benchmarks.peers import generation_config  # noqa: E402
from cbcore.benchmarks.workloads import build_workload  # noqa: E402
from cbcore.openmp_team import release_caller_openmp_team  # noqa: E402


def minor_faults() -> int:
    """Minor page faults of this process so far (every thread's)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="W2", choices=("W1", "W2", "W3"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile-level", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    workload = build_workload(args.workload)
    model = AutoModelForCausalLM.from_pretrained(model_folder(workload.model), dtype=getattr(torch, args.dtype)).eval()
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in workload.prompts),
                          max_generated_length=workload.max_new_tokens, num_requests=len(workload.prompts))
    config = cbcore.ContinuousBatchingConfig(default_compile_level=args.compile_level)
    manager = cbcore.ContinuousBatchingManager(model, generation_config(workload), config, hints)
    manager.warmup()
    engine = manager.engine

    # Per layer: the cache write and the decode kernel, timed around the Python calls the eager step's attention
    # makes (the compiled step's op calls them from C++: csrc/attention/cpu_step_attention.cpp).
    layer_seconds: dict[str, list[float]] = collections.defaultdict(list)
    kernels = ops.cpu_kernels()
    for owner, name in ((ops, "cache_write"), (kernels, "decode_attention_planned")):
        original = getattr(owner, name)

        def timed(*a, _original=original, _name=name, **k):
            began = time.perf_counter()
            result = _original(*a, **k)
            layer_seconds[_name].append(time.perf_counter() - began)
            return result

        setattr(owner, name, timed)

    steps: list[tuple[str, int, float, int]] = []  # (kind, tokens, seconds, minor faults)
    runner_prepare = manager.runner.prepare

    def prepare(batch):
        steps.append(("prefill" if any(r.num_tokens > 1 for r in batch.requests) else "decode",
                      sum(r.num_tokens for r in batch.requests), 0.0, 0))
        return runner_prepare(batch)

    manager.runner.prepare = prepare

    def loop() -> None:
        engine.binding.attach()
        workload.add_to_engine(engine, manager.default_eos_token_id)
        with torch.inference_mode():
            while engine.has_work():
                faults, began = minor_faults(), time.perf_counter()
                engine.step()
                kind, tokens, _, _ = steps[-1]
                steps[-1] = (kind, tokens, time.perf_counter() - began, minor_faults() - faults)
        engine.binding.detach()

    release_caller_openmp_team()  # as the manager's start() does: one OpenMP team, the loop thread's
    began = time.perf_counter()
    thread = threading.Thread(target=loop)  # a thread of its own: malloc gives it an arena of its own
    thread.start()
    thread.join()
    wall = time.perf_counter() - began

    print(f"{args.workload} {args.dtype}, {args.threads} threads, compile level {args.compile_level}: {wall:.3f} s")
    print("| step | kind | tokens | ms | minor faults |\n|---:|---|---:|---:|---:|")
    for index, (kind, tokens, seconds, faults) in enumerate(steps):
        if kind == "prefill" or index < 8:
            print(f"| {index} | {kind} | {tokens} | {1000 * seconds:.1f} | {faults} |")
    decode = [s for s in steps if s[0] == "decode"]
    if decode:
        print(f"decode steps: {len(decode)}, median {1000 * statistics.median(s[2] for s in decode):.2f} ms, "
              f"median {statistics.median(s[3] for s in decode):.0f} minor faults")
    for name, seconds in layer_seconds.items():
        print(f"{name}: median {1000 * statistics.median(seconds):.3f} ms a call ({len(seconds)} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
