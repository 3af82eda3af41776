"""Where a step's time goes: W1 through cbcore's engine, with each part of a step timed.

    python bench/profile_step.py [--workload W1] [--dtype float32] [--threads 2]
    python bench/profile_step.py --decode-requests 256      # decode steps of 256 requests (16-token prompts)

Runs the workload's requests through the manager's `EngineCore`, stepped in this thread (`EngineCore.step()`, as the
manager's loop thread runs it) and times, per step: scheduling (`Scheduler.schedule` + `on_step_done`), building the batch
(`ModelRunner.prepare`), the forward, and sampling; inside the forward: the linear layers, the attention kernels
(`ops.cache_write`, `decode_attention`, `prefill_attention`) and the rest (norms, RoPE, activations, residuals, and
transformers' Python between them). Steps are split into decode-only steps and steps with prefill rows. The `host`
column is the step's host-side work: scheduling, building the batch, and everything around the forward and sampling
(block copies, advancing the requests, outputs). Writes `bench/results/profile_<W>_<dtype>.md` (with
`--decode-requests N`: `profile_decode<N>_<dtype>.md`, a workload of N requests of 16-token prompts generating 64
tokens each, all admitted at once, so its decode steps have N rows).

    python bench/profile_step.py --workload W1 --compile-level 1   # the compiled step

With `--compile-level N` the step's forward is compiled (warm-up first, not timed) and the parts come from
torch.profiler's events instead of timers (a compiled graph runs no Python a timer could wrap): `linear` is the
packed-linear op, `attention` the per-layer step-attention op (cache write and kernels), `graph_rest` the rest of the
compiled graph (inductor's fused norms, RoPE, activations, residual adds), `dynamo` Dynamo's guard checks and graph
entry, `host` the step's time outside the forward. The profiler costs a few microseconds per recorded op, so these
steps run slightly slower than unprofiled ones. Writes `profile_<W>_<dtype>_compiled<N>.md`. `--top-ops N` also
prints the N events of the decode steps (or, with `--top-ops-steps prefill`, the prefill steps) with the most self
CPU time (what the parts are made of).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.continuous_batching.utils import WorkloadHints

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cbcore  # noqa: E402
from cbcore.benchmarks.models import RANDOM_LLAMA, model_folder  # noqa: E402
from cbcore.benchmarks.peers import generation_config  # noqa: E402
from cbcore.benchmarks.workloads import build_workload  # noqa: E402
from cbcore import ops  # noqa: E402

PARTS = ("schedule", "prepare", "linear", "attention", "forward_rest", "sample", "other")
COMPILED_PARTS = ("host", "linear", "attention", "graph_rest", "dynamo")
HOST_PARTS = ("schedule", "prepare", "other")  # the step's host-side work around the forward and sampling


def decode_workload(base, num_requests: int):
    """`num_requests` requests of 16-token prompts generating 64 tokens each (named decode<N>)."""
    generator = torch.Generator().manual_seed(0)
    vocab = RANDOM_LLAMA["vocab_size"]
    base.prompts = [torch.randint(1, vocab, (16,), generator=generator).tolist() for _ in range(num_requests)]
    base.max_new_tokens = 64
    base.name = f"decode{num_requests}"
    base.length_distribution = "16-token prompts, 64 new tokens each"
    return base


class Timers:
    """Seconds per part for the step being run, folded into per-kind totals when the step ends."""

    def __init__(self) -> None:
        self.current: collections.Counter[str] = collections.Counter()
        self.totals = {"decode": collections.Counter(), "prefill": collections.Counter()}
        self.steps = collections.Counter()
        self.kind = "decode"  # of the step being run: "prefill" when it has a row of more than one token

    def wrap(self, name: str, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - start

        return timed


def main(argv: list[str] | None = None) -> int:
    """Profile one workload's steps and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="W1", choices=("W1", "W2", "W3", "W4", "W5"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--decode-requests", type=int, default=None,
                        help="profile decode steps of this many requests instead of a named workload")
    parser.add_argument("--top-ops", type=int, default=0, metavar="N",
                        help="with --compile-level: also print the N events of the decode steps with the most self "
                        "CPU time (what the parts are made of)")
    parser.add_argument("--top-ops-steps", default="decode", choices=("decode", "prefill"),
                        help="the steps --top-ops looks at")
    parser.add_argument("--compile-level", type=int, default=0, choices=(0, 1, 2, 3),
                        help="compile the step's forward at this default_compile_level (parts from torch.profiler)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    workload = build_workload(args.workload)
    if args.decode_requests is not None:
        workload = decode_workload(workload, args.decode_requests)
    model = AutoModelForCausalLM.from_pretrained(model_folder(workload.model), dtype=getattr(torch, args.dtype)).eval()
    longest = max(len(p) for p in workload.prompts)
    hints = WorkloadHints(max_prompt_length=longest, max_generated_length=workload.max_new_tokens,
                          num_requests=len(workload.prompts))
    config = cbcore.ContinuousBatchingConfig(default_compile_level=args.compile_level)
    if args.decode_requests is not None:  # every request in one step's budget, so decode steps have them all
        config = cbcore.ContinuousBatchingConfig(max_requests_per_batch=args.decode_requests,
                                                 max_batch_tokens=16 * args.decode_requests, safety_margin=0.0,
                                                 default_compile_level=args.compile_level)
    manager = cbcore.ContinuousBatchingManager(model, generation_config(workload), config, hints)
    manager.warmup()  # builds the engine this thread steps
    engine = manager.engine
    engine.binding.attach()  # what start() does to the model: cbcore's attention and the packed linears
    if args.compile_level:
        return profile_compiled(manager, workload, args)
    timers = Timers()
    scheduler, runner = manager.scheduler, manager.runner
    scheduler.schedule = timers.wrap("schedule", scheduler.schedule)
    scheduler.on_step_done = timers.wrap("schedule", scheduler.on_step_done)
    prepare = timers.wrap("prepare", runner.prepare)

    def prepare_and_classify(batch):
        timers.kind = "prefill" if any(item.num_tokens > 1 for item in batch.requests) else "decode"
        timers.current["rows"] += len(batch.requests)
        return prepare(batch)

    runner.prepare = prepare_and_classify
    runner.sampler.sample = timers.wrap("sample", runner.sampler.sample)
    for name in ("cache_write", "decode_attention", "prefill_attention"):
        setattr(ops, name, timers.wrap("attention", getattr(ops, name)))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = timers.wrap("linear", module.forward)
    forward = model.forward
    model.forward = timers.wrap("forward", forward)

    workload.add_to_engine(engine, manager.default_eos_token_id)
    started = time.perf_counter()
    with torch.inference_mode():
        while engine.has_work():
            step_start = time.perf_counter()
            timers.kind = "decode"
            engine.step()
            elapsed = time.perf_counter() - step_start
            part, kind = timers.current, timers.kind
            part["forward_rest"] = part.pop("forward", 0.0) - part["linear"] - part["attention"]
            part["other"] = elapsed - sum(part[p] for p in PARTS if p != "other")
            timers.totals[kind].update(part)
            timers.steps[kind] += 1
            timers.current = collections.Counter()
    wall = time.perf_counter() - started
    engine.binding.detach()  # the model's own attention implementation and linears again
    generated = engine.stats()["generated_tokens"]
    lines = [
        f"# Where a {workload.name} step goes ({args.dtype}, {args.threads} threads)",
        "",
        f"`python bench/profile_step.py --workload {workload.name} --dtype {args.dtype} --threads {args.threads}`: "
        f"{len(workload.prompts)} requests, {workload.length_distribution}; {generated} tokens in {wall:.2f} s "
        f"({generated / wall:.0f} tok/s, stepped in the main thread, timers on).",
        "",
        "| steps | count | requests/step | ms/step | host ms/step | " + " | ".join(PARTS) + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(PARTS),
    ]
    for kind, totals in timers.totals.items():
        count = timers.steps[kind]
        if not count:
            continue
        step_ms = 1000 * sum(totals[p] for p in PARTS) / count
        cells = " | ".join(f"{1000 * totals[p] / count:.1f} ({100 * totals[p] / (step_ms * count / 1000):.0f}%)" for p in PARTS)
        host_ms = 1000 * sum(totals[p] for p in HOST_PARTS) / count
        rows = totals["rows"] / count
        lines.append(f"| {kind} | {count} | {rows:.0f} | {step_ms:.1f} | {host_ms:.2f} | {cells} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"profile_{workload.name}_{args.dtype}.md").write_text(text)
    return 0


def profile_compiled(manager, workload, args) -> int:
    """The compiled step's parts, from torch.profiler's events attributed to the step they ran in."""
    import bisect

    from torch.profiler import ProfilerActivity, profile, record_function

    engine, runner = manager.engine, manager.runner
    kinds: list[str] = []  # per step: "decode", "prefill", or "none" (a step that ran no forward)
    this_step: list[str] = []
    prepare = runner.prepare

    def prepare_and_classify(batch):
        this_step.append("prefill" if any(item.num_tokens > 1 for item in batch.requests) else "decode")
        with record_function("cbcore_prepare"):  # building the step's inputs: part of `host`, named in --top-ops
            return prepare(batch)

    runner.prepare = prepare_and_classify
    workload.add_to_engine(engine, manager.default_eos_token_id)
    step_ranges: list[tuple[int, int]] = []  # (start, end) in the profiler's microseconds, per step
    started = time.perf_counter()
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_work():
            this_step.clear()
            with record_function("cbcore_step"):
                engine.step()
            kinds.append(this_step[0] if this_step else "none")
    wall = time.perf_counter() - started
    engine.binding.detach()
    events = prof.events()
    steps = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == "cbcore_step")
    starts = [start for start, _ in steps]
    totals = {"decode": collections.Counter(), "prefill": collections.Counter()}
    counts = collections.Counter(k for k in kinds if k != "none")

    def kind_at(moment: float) -> str | None:
        """The kind of the step running at `moment` (None outside steps, or in a step without a forward)."""
        index = bisect.bisect_right(starts, moment) - 1
        return kinds[index] if 0 <= index < len(kinds) and kinds[index] in totals else None

    for start, end in steps:
        kind = kind_at(start)
        if kind is not None:
            totals[kind]["step"] += end - start
    names = {"cbcore::packed_linear": "linear", "cbcore::step_attention": "attention"}
    for event in events:
        kind = kind_at(event.time_range.start)
        if kind is None:
            continue
        part = names.get(event.name)
        if part is not None:
            totals[kind][part] += event.cpu_time_total
        elif event.name.startswith("## Call CompiledFxGraph"):
            totals[kind]["graph"] += event.cpu_time_total
        elif event.name.startswith("Torch-Compiled Region"):
            totals[kind]["region"] += event.cpu_time_total
        elif event.name == "TorchDynamo Cache Lookup":
            totals[kind]["lookup"] += event.cpu_time_total
        elif event.name == "cbcore_prepare":
            totals[kind]["prepare"] += event.cpu_time_total
    generated = engine.stats()["generated_tokens"]
    lines = [
        f"# Where a {workload.name} step goes, compiled at level {args.compile_level} ({args.dtype}, "
        f"{args.threads} threads)",
        "",
        f"`python bench/profile_step.py --workload {workload.name} --dtype {args.dtype} --threads {args.threads} "
        f"--compile-level {args.compile_level}`: {len(workload.prompts)} requests, {workload.length_distribution}; "
        f"{generated} tokens in {wall:.2f} s ({generated / wall:.0f} tok/s, stepped in the main thread under "
        "torch.profiler). Parts: see the script's docstring.",
        "",
        "| steps | count | ms/step | " + " | ".join(COMPILED_PARTS) + " |",
        "|---|---:|---:|" + "---:|" * len(COMPILED_PARTS),
    ]
    for kind, t in totals.items():
        if not counts[kind]:
            continue
        parts = {
            "linear": t["linear"], "attention": t["attention"],
            "graph_rest": t["graph"] - t["linear"] - t["attention"],
            "dynamo": t["region"] - t["graph"] + t["lookup"],
        }
        parts["host"] = t["step"] - t["region"] - t["lookup"]
        step_us = t["step"] / counts[kind]
        cells = " | ".join(f"{parts[p] / counts[kind] / 1000:.2f} ({100 * parts[p] / t['step']:.0f}%)"
                           for p in COMPILED_PARTS)
        lines.append(f"| {kind} | {counts[kind]} | {step_us / 1000:.2f} | {cells} |")
    prepares = ", ".join(f"{kind} {t['prepare'] / counts[kind] / 1000:.2f} ms" for kind, t in totals.items()
                         if counts[kind])
    lines += ["", f"Of `host`, building the step's inputs (`ModelRunner.prepare`) per step: {prepares}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.top_ops:
        print(_top_ops(events, kind_at, args.top_ops_steps, counts[args.top_ops_steps], args.top_ops))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"profile_{workload.name}_{args.dtype}_compiled{args.compile_level}.md").write_text(text)
    return 0


def _top_ops(events, kind_at, kind: str, steps: int, n: int) -> str:
    """The n event names of the steps of `kind` (decode or prefill) with the most self CPU time, in microseconds per
    step."""
    self_us, calls = collections.Counter(), collections.Counter()
    for event in events:
        if kind_at(event.time_range.start) == kind:
            self_us[event.name] += event.self_cpu_time_total
            calls[event.name] += 1
    rows = ["| event | calls/step | self us/step |", "|---|---:|---:|"]
    for name, total in self_us.most_common(n):
        rows.append(f"| {name[:90]} | {calls[name] / max(1, steps):.1f} | {total / max(1, steps):.0f} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
