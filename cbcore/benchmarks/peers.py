"""One peer of the side-by-side benchmark, run in its own process so that its memory and threads are its own.

    python -m cbcore.benchmarks.peers SPEC.json OUT.json

SPEC names the peer, the workload, the dtype, the torch thread count and the model cache folder. The peers that run in cbcore's venv:
    reference     `model.generate` one prompt at a time (the tokens every other peer is compared with)
    cbcore        cbcore's `generate_batch`
    transformers  transformers' own continuous batching, `model.generate_batch` (transformers 5.24)
    generate      padded `model.generate` in batches of `generate_batch_size` (left padding, attention mask)

OUT gets, per request, the generated tokens and the time of each token in seconds since the start of the timed call
(`t0`, taken just before the call, after a warm-up call on two short prompts), plus the wall time and the number of
prefilled tokens (prompt tokens run through the model, padding and recomputation included). vLLM runs through
`cbcore/benchmarks/vllm_runner.py` in its own venv instead and writes the same OUT format.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from cbcore.benchmarks.models import model_folder
from cbcore.benchmarks.workloads import Workload, build_workload

PEERS_IN_PROCESS = ("reference", "cbcore", "transformers", "generate")
PAD_TOKEN_ID = 0


class StepClock(BaseStreamer):
    """A `model.generate` streamer that stamps the time of every generated step (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        """transformers' streamer hook: stamp every generated token (the prompt, passed first, is skipped)."""
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        """transformers' streamer hook at the end of generation: nothing to do."""
        pass


class ForwardTokenCounter:
    """Counts the query tokens of every forward call (a forward pre-hook), to derive prefilled tokens."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tokens = 0
        self._handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None:
            self.tokens += input_ids.numel()

    def remove(self) -> None:
        """Take the forward hook off the model."""
        self._handle.remove()


def generation_config(workload: Workload) -> GenerationConfig:
    """Greedy, exactly `max_new_tokens` unless the workload has an EOS."""
    return GenerationConfig(
        max_new_tokens=workload.max_new_tokens,
        do_sample=False,
        eos_token_id=workload.eos_token_id,
        pad_token_id=PAD_TOKEN_ID if workload.eos_token_id is None else workload.eos_token_id,
        bos_token_id=None,
    )


def _cut_at_eos(tokens: list[int], eos: int | list[int] | None) -> list[int]:
    """`model.generate` pads a finished row after its EOS; keep the tokens up to and including the EOS."""
    if eos is None:
        return tokens
    stops = {eos} if isinstance(eos, int) else set(eos)
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens


def run_reference(model, workload: Workload, gen: GenerationConfig) -> dict[str, Any]:
    """`model.generate` one prompt at a time, each request waiting for the previous one."""
    model.generate(torch.tensor([workload.prompts[0][:8]]), generation_config=gen, max_new_tokens=2)  # warm-up
    tokens, times = [], []
    t0 = time.perf_counter()
    for prompt in workload.prompts:
        clock = StepClock()
        out = model.generate(torch.tensor([prompt]), generation_config=gen, streamer=clock)
        row = _cut_at_eos(out[0, len(prompt) :].tolist(), workload.eos_token_id)
        tokens.append(row)
        times.append([s - t0 for s in clock.stamps[: len(row)]])
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "token_times": times, "wall_s": wall, "prefilled_tokens": workload.prompt_tokens}


def run_padded_generate(model, workload: Workload, gen: GenerationConfig, batch_size: int) -> dict[str, Any]:
    """`model.generate` over left-padded batches of `batch_size` prompts, in workload order."""
    model.generate(torch.tensor([workload.prompts[0][:8]] * 2), generation_config=gen, max_new_tokens=2)  # warm-up
    tokens, times, prefilled = [], [], 0
    t0 = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        batch = workload.prompts[first : first + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.full((len(batch), width), PAD_TOKEN_ID, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        prefilled += input_ids.numel()
        clock = StepClock()
        out = model.generate(input_ids, attention_mask=attention_mask, generation_config=gen, streamer=clock)
        for row in range(len(batch)):
            generated = _cut_at_eos(out[row, width:].tolist(), workload.eos_token_id)
            tokens.append(generated)
            times.append([s - t0 for s in clock.stamps[: len(generated)]])
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "token_times": times, "wall_s": wall, "prefilled_tokens": prefilled}


def run_generate_batch(model, workload: Workload, gen: GenerationConfig, cb_config=None, count_prefill: bool = True
                       ) -> dict[str, Any]:
    """`model.generate_batch` (cbcore's when the model was passed through `cbcore.enable`, else transformers'). The
    warm-up call compiles the step when `cb_config` asks for it: its graphs are kept per model, so the timed call
    reuses them. `count_prefill`: count the forwards' tokens with a hook; not for a compiled step, whose graph would
    not run the hook's Python (and adding a hook after compiling makes cbcore compile again, in the timed call)."""
    model.generate_batch([p[:8] for p in workload.prompts[:2]], gen, cb_config, max_new_tokens=4)  # warm-up
    counter = ForwardTokenCounter(model) if count_prefill else None
    t0 = time.perf_counter()
    outputs = model.generate_batch(workload.prompts, gen, cb_config, record_timestamps=True)
    wall = time.perf_counter() - t0
    if counter is not None:
        counter.remove()
    ordered = list(outputs.values())
    if len(ordered) != len(workload.prompts):
        raise RuntimeError(f"generate_batch returned {len(ordered)} outputs for {len(workload.prompts)} requests")
    failed = [o.request_id for o in ordered if getattr(o, "error", None)]
    if failed:
        raise RuntimeError(f"requests failed: {failed[:5]}")
    tokens = [list(o.generated_tokens) for o in ordered]
    times = [[s - t0 for s in (o.timestamps or [])] for o in ordered]
    # Every generated token but the last is fed back once as a one-token decode query; the rest is prefill.
    decode_queries = sum(max(len(t) - 1, 0) for t in tokens)
    prefilled = counter.tokens - decode_queries if counter is not None and counter.tokens else -1  # -1: not counted
    return {"tokens": tokens, "token_times": times, "wall_s": wall, "prefilled_tokens": prefilled}


def run_peer(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the workload's model in `spec["dtype"]` and run `spec["peer"]` on it."""
    torch.set_num_threads(spec["threads"])
    workload = build_workload(spec["workload"], spec.get("limit_requests"), spec.get("max_new_tokens"))
    dtype = getattr(torch, spec["dtype"])
    folder = model_folder(workload.model, spec.get("cache_dir"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    gen = generation_config(workload)
    peer = spec["peer"]
    with torch.inference_mode():
        if peer == "reference":
            return run_reference(model, workload, gen)
        if peer == "generate":
            return run_padded_generate(model, workload, gen, spec["generate_batch_size"])
        if peer == "cbcore":
            import cbcore

            from cbcore.compiled_step import compile_seconds

            cbcore.enable(model)
            level = spec.get("compile_level", 0)
            config = cbcore.ContinuousBatchingConfig(default_compile_level=level)
            result = run_generate_batch(model, workload, gen, config, count_prefill=level == 0)
            result["compile_level"], result["compile_s"] = level, compile_seconds(model)
            return result
        if peer == "transformers":
            return run_generate_batch(model, workload, gen)
    raise ValueError(f"unknown peer {peer!r}; choose one of {PEERS_IN_PROCESS}")


def _peak_rss_bytes() -> int | None:
    """This process's peak resident set (VmHWM), for a cross-check of the parent's sampling."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main(argv: list[str]) -> int:
    """`SPEC.json OUT.json`: run the peer the spec names and write its raw result."""
    spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    result = run_peer(spec)
    result["self_peak_rss_bytes"] = _peak_rss_bytes()
    result["torch_threads"] = torch.get_num_threads()
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
