"""What the per-request sampling controls cost: W1 (64 requests, prompts 32..256 tokens, 128 new tokens, the bench's
32M-parameter random Llama, fp32) through one manager with every control on against every control off, interleaved,
three rounds each, medians of the generated tokens per second.

Both arms sample (temperature 0.8, each request seeded) so that min_p is allowed; "on" gives every request
repetition / frequency / presence penalties, a logit_bias of 8 tokens, min_p 0.05, min_tokens 16, two stop token ids
(never sampled with their bias of -100, so every request still generates 128 tokens) and two bad words.

    python bench/sampling_controls.py [--rounds 3] [--out bench/results/sampling_controls_W1.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import cbcore
from cbcore.benchmarks.models import model_folder
from cbcore.benchmarks.workloads import build_workload

CONTROLS = {
    "repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.1,
    "logit_bias": {11: 2.0, 12: -2.0, 13: 1.0, 14: -1.0, 15: 0.5, 16: -0.5, 21: -100.0, 22: -100.0},
    "min_p": 0.05, "min_tokens": 16, "stop_token_ids": [21, 22], "bad_words_ids": [[30], [31, 32]],
}


def run(model, prompts: list[list[int]], max_new_tokens: int, controls: dict) -> tuple[float, int]:
    """Seconds to serve every prompt, and the tokens generated."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, eos_token_id=None,
                              pad_token_id=0)
    manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(
        per_request_processors=True))
    manager.start()
    try:
        started = time.perf_counter()
        ids = [manager.add_request(prompt, seed=index, **controls) for index, prompt in enumerate(prompts)]
        tokens = 0
        for rid in ids:
            for output in manager.request_id_iter(rid):
                if output.is_finished():
                    assert output.error is None, output.error
                    tokens += len(output.generated_tokens)
        return time.perf_counter() - started, tokens
    finally:
        manager.stop(block=True)


def main() -> None:
    """Interleave the two arms, print and write the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    workload = build_workload("W1")
    model = AutoModelForCausalLM.from_pretrained(model_folder(workload.model), dtype=torch.float32).eval()
    run(model, workload.prompts[:4], 16, CONTROLS)  # warm-up: first-touch costs out of the timed rounds
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for round_index in range(args.rounds):
        for arm, controls in (("off", {}), ("on", CONTROLS)) if round_index % 2 == 0 else (("on", CONTROLS),
                                                                                           ("off", {})):
            seconds, tokens = run(model, workload.prompts, workload.max_new_tokens, controls)
            rates[arm].append(tokens / seconds)
            print(f"round {round_index + 1} {arm}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s")
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    lines = [
        "# Sampling controls on W1: all on against all off",
        "",
        f"Command: `python bench/sampling_controls.py --rounds {args.rounds}` (interleaved arms, medians).",
        "",
        f"Conditions: torch {torch.__version__}, {torch.get_num_threads()} threads; model {workload.model}, fp32; "
        f"{len(workload.prompts)} requests ({workload.length_distribution}), sampled at temperature 0.8; "
        "the controls of `CONTROLS` in bench/sampling_controls.py.",
        "",
        "| arm | tok/s (median) | rounds |",
        "|---|---|---|",
        f"| all off | {off:.1f} | {', '.join(f'{r:.1f}' for r in rates['off'])} |",
        f"| all on | {on:.1f} | {', '.join(f'{r:.1f}' for r in rates['on'])} |",
        "",
        f"All on / all off: {on / off:.3f}.",
    ]
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
