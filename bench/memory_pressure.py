"""Memory-pressure benchmark: one workload, four runs side by side in one process.

    python bench/memory_pressure.py [--requests 24] [--new-tokens 48] [--out bench/results]

1. cbcore, a cache big enough for every request at once (the reference point);
2. cbcore, a tight cache (about a quarter of the workload) with swap to host (`cpu_offload_space`);
3. cbcore, the same tight cache, recompute only;
4. transformers' own continuous batching with the same tight cache (it re-prefills what it evicts; its offload needs
   a GPU, so it runs without).

Model: a seeded random Llama (vocab 4096, hidden 256, 4 layers, 8 heads, 4 KV heads), fp32, on the CPU. Greedy tokens
of every run are compared with run 1's. Results go to `<out>/memory_pressure.json` and `.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import ContinuousBatchingConfig as TransformersCBConfig
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout: find `cbcore`

import cbcore  # noqa: E402
from cbcore.benchmarks.machine import cpu_model  # noqa: E402

PAGE = 16


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    return LlamaForCausalLM(config).eval()


def workload(num_requests: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 193, (num_requests,), generator=generator).tolist()
    return [torch.randint(1, 4096, (n,), generator=generator).tolist() for n in lengths]


def run_cbcore(model, prompts, gen, num_blocks: int, offload_gib: float) -> dict:
    config = cbcore.ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks, max_batch_tokens=512,
                                             cpu_offload_space=offload_gib)
    manager = cbcore.ContinuousBatchingManager(model, gen, config)
    manager.warmup()
    manager.start()
    start = time.perf_counter()
    ids = manager.add_requests(prompts)
    finals = {}
    while len(finals) < len(ids):
        output = manager.get_result(timeout=600)
        if output is not None and output.is_finished():
            finals[output.request_id] = output
    elapsed = time.perf_counter() - start
    manager.stop()
    stats = manager.stats()
    return {
        "seconds": elapsed,
        "tokens": [finals[rid].generated_tokens for rid in ids],
        "failed": sum(finals[rid].error is not None for rid in ids),
        "preemptions": stats["preemptions"],
        "recomputed_tokens": stats["recomputed_tokens"],
        "swap_bytes_out": stats.get("swap_bytes_out", 0),
        "swap_bytes_in": stats.get("swap_bytes_in", 0),
        "peak_cache_mib": manager.cache.nbytes / 2**20,
    }


def run_transformers(model, prompts, gen, num_blocks: int) -> dict:
    config = TransformersCBConfig(page_size=PAGE, num_blocks=num_blocks, max_batch_tokens=512)
    start = time.perf_counter()
    outputs = type(model).generate_batch(model, prompts, generation_config=gen, continuous_batching_config=config)
    elapsed = time.perf_counter() - start
    ordered = [outputs[f"req_{i}"] for i in range(len(prompts)) if f"req_{i}" in outputs]
    return {
        "seconds": elapsed,
        "tokens": [o.generated_tokens for o in ordered],
        "failed": len(prompts) - sum(o.error is None for o in ordered),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()

    torch.set_num_threads(2)
    model = build_model()
    prompts = workload(args.requests)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    need_blocks = sum(-(-(len(p) + args.new_tokens) // PAGE) for p in prompts)
    tight = max(need_blocks // 4, max(-(-(len(p) + args.new_tokens) // PAGE) for p in prompts) + 1)

    runs = {
        "cbcore, generous cache": run_cbcore(model, prompts, gen, need_blocks + 8, 0.0),
        "cbcore, tight cache + swap": run_cbcore(model, prompts, gen, tight, 1.0),
        "cbcore, tight cache, recompute": run_cbcore(model, prompts, gen, tight, 0.0),
        "transformers, tight cache": run_transformers(model, prompts, gen, tight),
    }
    reference = runs["cbcore, generous cache"]["tokens"]
    generated = sum(len(t) for t in reference)
    rows = []
    for name, run in runs.items():
        rows.append({
            "run": name,
            "seconds": round(run["seconds"], 2),
            "generated_tok_per_s": round(generated / run["seconds"], 1),
            "same_tokens_as_generous": run["tokens"] == reference,
            "failed": run["failed"],
            **{k: run[k] for k in ("preemptions", "recomputed_tokens", "swap_bytes_out", "swap_bytes_in") if k in run},
        })
    facts = {
        "hardware": f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads",
        "model": "seeded random Llama: vocab 4096, hidden 256, 4 layers, 8 heads / 4 KV heads, fp32",
        "requests": args.requests,
        "lengths": f"prompts 64-192 tokens (uniform), {args.new_tokens} new tokens each, greedy",
        "cache": f"page {PAGE}; generous {need_blocks + 8} blocks, tight {tight} blocks",
        "command": f"python bench/memory_pressure.py --requests {args.requests} --new-tokens {args.new_tokens}",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_pressure.json").write_text(json.dumps({"facts": facts, "rows": rows}, indent=2) + "\n")
    lines = ["# Memory pressure", "", *[f"- {k}: {v}" for k, v in facts.items()], "",
             "| run | s | gen tok/s | same tokens | failed | preemptions | recomputed tokens | swap out / in (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        swap = f"{row.get('swap_bytes_out', 0) / 2**20:.1f} / {row.get('swap_bytes_in', 0) / 2**20:.1f}"
        lines.append(f"| {row['run']} | {row['seconds']} | {row['generated_tok_per_s']} | {row['same_tokens_as_generous']} "
                     f"| {row['failed']} | {row.get('preemptions', '-')} | {row.get('recomputed_tokens', '-')} | {swap} |")
    (args.out / "memory_pressure.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
