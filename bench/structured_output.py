"""What structured output costs: a W1-shaped load (64 requests, prompts uniform in 32..256 tokens, 128 new tokens)
with a JSON-schema constraint on every request against none, through one manager, interleaved (the order
alternating round by round), four rounds each after a warm-up round; medians of the generated tokens per second
and of the share of step time spent filling and applying the token masks.

The model is W1's seeded random Llama (32M parameters without its head, fp32) with the default model's vocabulary
(49,152 tokens, so that its tokenizer compiles the grammar). Greedy, no EOS: a random model, once inside the schema's
free-text field, stays there, so both arms generate 128 tokens per request and the masks are filled at every step
of every request (the first tokens walk the schema's structure: keys, an enum, an integer).

    python bench/structured_output.py [--rounds 4] [--out bench/results/structured_output_W1.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import cbcore
from cbcore.benchmarks.models import RANDOM_LLAMA
from cbcore.benchmarks.workloads import build_workload
from cbcore.default_model import load_model_and_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "priority": {"enum": ["low", "medium", "high"]},
        "tags": {"type": "array", "items": {"enum": ["bug", "feature", "docs"]}, "maxItems": 3},
        "notes": {"type": "string"},
    },
    "required": ["id", "priority", "tags", "notes"],
    "additionalProperties": False,
}


def run(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, constrained: bool) -> dict[str, float]:
    """Serve every prompt; the seconds, tokens generated, steps, and (constrained) the mask's seconds."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(), tokenizer=tokenizer)
    manager.start()
    extra = {"structured_output": {"json": SCHEMA, "disable_any_whitespace": True}} if constrained else {}
    try:
        started = time.perf_counter()
        ids = [manager.add_request(prompt, **extra) for prompt in prompts]
        tokens = 0
        for rid in ids:
            for output in manager.request_id_iter(rid):
                if output.is_finished():
                    assert output.error is None, output.error
                    tokens += len(output.generated_tokens)
        seconds = time.perf_counter() - started
        stats = manager.stats()
    finally:
        manager.stop(block=True)
    return {"seconds": seconds, "tokens": tokens, "steps": stats["steps"],
            "masked_steps": stats["structured_output_steps"], "mask_seconds": stats["structured_output_mask_seconds"]}


def main() -> None:
    """Interleave the two arms, print and write the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    _, tokenizer = load_model_and_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**RANDOM_LLAMA, "vocab_size": len(tokenizer)})).eval()
    workload = build_workload("W1")
    prompts = [[token + 100 for token in prompt] for prompt in workload.prompts]  # clear of the special tokens
    # Warm-up, one whole untimed round of each arm: the process's first touches of memory and the grammar's compile
    # stay out of the rounds (the first rounds of a fresh process run ~10% slower than the later ones).
    for constrained in (False, True):
        run(model, tokenizer, prompts, workload.max_new_tokens, constrained)
    results: dict[str, list[dict[str, float]]] = {"none": [], "json": []}
    for round_index in range(args.rounds):
        for arm in ("none", "json") if round_index % 2 == 0 else ("json", "none"):
            result = run(model, tokenizer, prompts, workload.max_new_tokens, arm == "json")
            results[arm].append(result)
            share = result["mask_seconds"] / result["seconds"]
            print(f"round {round_index + 1} {arm}: {result['tokens']} tokens in {result['seconds']:.1f} s = "
                  f"{result['tokens'] / result['seconds']:.1f} tok/s, {result['steps']} steps, mask "
                  f"{share:.1%} of the time")
    rate = {arm: statistics.median(r["tokens"] / r["seconds"] for r in runs) for arm, runs in results.items()}
    json_runs = results["json"]
    per_step_ms = statistics.median(r["mask_seconds"] / r["masked_steps"] * 1e3 for r in json_runs)
    step_ms = statistics.median(r["seconds"] / r["steps"] * 1e3 for r in json_runs)
    share = statistics.median(r["mask_seconds"] / r["seconds"] for r in json_runs)
    lines = [
        "# Structured output on a W1-shaped load: a JSON schema on every request against none",
        "",
        f"Command: `python bench/structured_output.py --rounds {args.rounds}` (interleaved arms, medians).",
        "",
        f"Conditions: torch {torch.__version__}, {torch.get_num_threads()} threads; W1's random Llama shape with the "
        f"default model's vocabulary ({len(tokenizer)} tokens), fp32; {len(prompts)} requests "
        f"({workload.length_distribution}), greedy, no EOS; the schema of `SCHEMA` in bench/structured_output.py, "
        "compact JSON.",
        "",
        "| arm | tok/s (median) | rounds |",
        "|---|---|---|",
    ]
    for arm, runs in results.items():
        rounds = ", ".join(f"{r['tokens'] / r['seconds']:.1f}" for r in runs)
        lines.append(f"| {'JSON schema' if arm == 'json' else 'none'} | {rate[arm]:.1f} | {rounds} |")
    lines += [
        "",
        f"JSON schema / none: {rate['json'] / rate['none']:.3f}. Mask per step (fill every constrained row's "
        f"bitmask and apply it): {per_step_ms:.2f} ms of a {step_ms:.1f} ms step, {share:.1%} of the wall time.",
    ]
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
