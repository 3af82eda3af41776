"""Never silently wrong: every transformers architecture is served exactly (same greedy tokens as `model.generate`)
or refused before serving anything, with an error naming the model, on every transformers version cbcore supports.
The harness is tests/architecture_sweep.py; the committed tables are docs/architecture_sweep.md (transformers 5.24)
and docs/architecture_sweep_5.25.md.

A representative subset always runs in-process (a few seconds); the full sweep over every model type in
`MODEL_FOR_CAUSAL_LM_MAPPING` takes about 1.5 minutes in two one-thread processes on a 2-core machine
(`CBCORE_SWEEP_JOBS=1`: one process), so it runs by default too.
"""

from __future__ import annotations

import os

import pytest
import transformers

import architecture_sweep as sweep

TRANSFORMERS = tuple(int(part) for part in transformers.__version__.split(".")[:2])

# model type -> (expected result, a phrase of the reason). One per cause found by the sweep, plus the features
# that must keep working (sliding windows, soft-capping, sinks, MLA, MoE).
REPRESENTATIVE = {
    "llama": (sweep.SAME, ""),
    "gpt2": (sweep.SAME, ""),
    "mistral": (sweep.SAME, ""),  # sliding window, shorter than the long prompt
    "gemma2": (sweep.SAME, ""),  # attention logit soft-capping
    "gpt_oss": (sweep.SAME, ""),  # attention sinks
    "deepseek_v3": (sweep.SAME, ""),  # multi-head latent attention (separate K/V head dims)
    "qwen2_moe": (sweep.SAME, ""),
    "qwen3_next": (sweep.SAME, ""),  # hybrid: gated delta-net layers on state slots
    "jamba": (sweep.SAME, ""),  # hybrid: a Mamba-1 mixer, continued one token at a time
    "mamba": (sweep.SAME, ""),  # no attention at all
    "lfm2": (sweep.SAME, ""),  # short convolutions (conv states only)
    "rwkv": (sweep.REFUSED, "outside transformers' cache API"),
    "zamba": (sweep.REFUSED, "no integer layer_idx"),  # a Mamba hybrid whose attention block is shared
    "llama4_text": (sweep.REFUSED, "chunked_attention"),
    "bart": (sweep.SAME, ""),  # positions from a cache length: the step's positions handed to its embedding
    "marian": (sweep.SAME, ""),  # the same, sinusoidal positions
    "whisper": (sweep.SAME, ""),  # no logits_to_keep (every row's logits), cross-attention never called
    "cpmant": (sweep.REFUSED, "position_ids"),  # positions computed elsewhere than a cache-length embedding
    "trocr": (sweep.REFUSED, "never called cbcore's attention"),  # its attention bypasses AttentionInterface
    "moshi": (sweep.REFUSED, "sliding_window"),  # the window lives only in the mask
    "gpt_neo": (sweep.REFUSED, "never called cbcore's attention"),  # attention outside AttentionInterface
    # transformers 5.25 moved Falcon's attention onto AttentionInterface: refused on 5.24, served exactly on 5.25.
    "falcon": (sweep.SAME, "") if TRANSFORMERS >= (5, 25) else (sweep.REFUSED, "never called cbcore's attention"),
    "stablelm": (sweep.SAME, ""),  # a decoder layer drops the kwargs: the step travels in a thread-local too
    "bert": (sweep.SAME, ""),  # encoder_hidden_states=None reaches attention: no cross-attention
    "jetmoe": (sweep.SAME, ""),  # KV heads per layer read off a probe forward, not the config
    "gemma4_text": (sweep.SAME, ""),  # layers of different K/V shapes (sliding and global)
    "diffllama": (sweep.REFUSED, "2 times"),  # one attention module called twice per forward
    "roberta": (sweep.SAME, ""),  # positions as generate passes them (0-based), not padding-offset
}


@pytest.mark.parametrize("model_type", list(REPRESENTATIVE))
def test_representative_architecture_is_served_exactly_or_refused(model_type: str) -> None:
    expected, phrase = REPRESENTATIVE[model_type]
    result = sweep.run_one(model_type)
    assert result.result == expected, f"{model_type}: {result.result}: {result.reason}"
    assert phrase in result.reason


def test_every_architecture_is_served_exactly_or_refused() -> None:
    jobs = int(os.environ.get("CBCORE_SWEEP_JOBS", "2"))
    results = sweep.sweep(sweep.all_model_types(), jobs=jobs)
    bad = [f"{r.model_type} ({r.model_class}): {r.result}: {r.reason}" for r in results
           if r.result in (sweep.WRONG, sweep.CRASH)]
    assert not bad, "\n".join(bad)
    counts = sweep.counts(results)
    # Guards against a harness regression that would turn models into SKIPs (or a check refusing too much).
    assert counts[sweep.SKIP] <= 16 and counts[sweep.SAME] >= 140, counts
