"""The sampler's draw against torch.multinomial, on the CPU: 64 rows and one row of a 49,152-token vocabulary
(SmolLM2's), probabilities from a softmax of random logits, 2 torch threads, three runs of 20 calls each.

    python bench/sampling_draw.py
"""

from __future__ import annotations

import time

import torch

from cbcore.sampling import draw


def _ms(function, calls: int = 20) -> float:
    function()
    started = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - started) / calls * 1e3


def main() -> None:
    """Print the per-call times of each run."""
    torch.set_num_threads(2)
    probs = torch.softmax(torch.randn(64, 49152, generator=torch.Generator().manual_seed(0)), dim=-1)
    generator = torch.Generator().manual_seed(0)
    for run in range(3):
        print(f"run {run + 1}: 64 rows: multinomial {_ms(lambda: torch.multinomial(probs, 1, generator=generator)):.1f}"
              f" ms, draw {_ms(lambda: draw(probs, generator)):.2f} ms; one row: multinomial "
              f"{_ms(lambda: torch.multinomial(probs[0], 1, generator=generator)):.2f} ms, draw "
              f"{_ms(lambda: draw(probs[:1], generator)):.3f} ms")


if __name__ == "__main__":
    main()
