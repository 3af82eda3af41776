"""A step's host-side time: everything `EngineCore.step()` does around the model's forward.

    python bench/host_step_time.py [--requests 256] [--workload W1] [--repeat 3]

The model's forward is replaced by a stub that returns zero logits of the right shape, so what is timed is the
host's work alone: scheduling, the step plan, the block copies, building the step's input tensors, sampling the
emitting rows (greedy: an argmax over the vocabulary) and advancing the requests (`update_from_output`). Two
workloads: `decode<N>`, N requests of 16-token prompts decoding together (each step has N rows; timed over 50 decode
steps after the real prefill), and W1's 64 requests (every step of the workload, prefills included). Prints the
median ms per step over `--repeat` runs (each in a fresh engine) with min-max.

Runs against any checkout of cbcore that has `EngineCore` (run it from that checkout's root to measure it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.continuous_batching.utils import WorkloadHints

sys.path.insert(0, str(Path.cwd()))  # the checkout being measured

import cbcore  # noqa: E402
from cbcore.benchmarks.models import RANDOM_LLAMA, model_folder  # noqa: E402
from cbcore.benchmarks.peers import generation_config  # noqa: E402
from cbcore.benchmarks.workloads import build_workload  # noqa: E402

DECODE_STEPS = 50


class _StubOutput:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


def _stub_forward(vocab: int):
    """A forward returning zero logits for the rows asked (`logits_to_keep`), as the model's would be shaped."""

    def forward(*args, logits_to_keep=None, input_ids=None, **kwargs):
        rows = len(logits_to_keep) if logits_to_keep is not None else input_ids.shape[1]
        return _StubOutput(torch.zeros(1, rows, vocab))

    return forward


def one_run(workload_name: str, num_requests: int | None) -> float:
    """ms of host work per step, in a fresh engine."""
    workload = build_workload(workload_name)
    if num_requests is not None:
        generator = torch.Generator().manual_seed(0)
        vocab = RANDOM_LLAMA["vocab_size"]
        workload.prompts = [torch.randint(1, vocab, (16,), generator=generator).tolist() for _ in range(num_requests)]
        workload.max_new_tokens = DECODE_STEPS + 10
    model = AutoModelForCausalLM.from_pretrained(model_folder(workload.model), dtype=torch.float32).eval()
    longest = max(len(p) for p in workload.prompts)
    hints = WorkloadHints(max_prompt_length=longest, max_generated_length=workload.max_new_tokens,
                          num_requests=len(workload.prompts))
    config = None
    if num_requests is not None:  # every request in one step's budget, so decode steps have them all
        config = cbcore.ContinuousBatchingConfig(max_requests_per_batch=num_requests,
                                                 max_batch_tokens=16 * num_requests, safety_margin=0.0)
    manager = cbcore.ContinuousBatchingManager(model, generation_config(workload), config, hints)
    manager.warmup()
    engine = manager.engine
    engine.binding.attach()
    workload.add_to_engine(engine, manager.default_eos_token_id)
    stub = _stub_forward(model.config.vocab_size)
    with torch.inference_mode():
        if num_requests is not None:
            engine.step()  # the real prefill of every prompt
        model.forward = stub
        steps, started = 0, time.perf_counter()
        while engine.has_work() and (num_requests is None or steps < DECODE_STEPS):
            engine.step()
            steps += 1
        elapsed = time.perf_counter() - started
    engine.binding.detach()
    return 1000 * elapsed / steps


def main(argv: list[str] | None = None) -> int:
    """Time the host side of the chosen workload's steps and print the median."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=None, help="decode steps of this many requests")
    parser.add_argument("--workload", default="W1", choices=("W1", "W2", "W3"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = [one_run(args.workload, args.requests) for _ in range(args.repeat)]
    name = f"decode{args.requests}" if args.requests is not None else args.workload
    print(f"{name}: host ms/step median {statistics.median(runs):.3f} (min {min(runs):.3f}, max {max(runs):.3f}, "
          f"{args.repeat} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
