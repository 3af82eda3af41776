"""The side-by-side benchmark's chart: generated tok/s and peak memory, one bar per peer at its median, with an
error bar from its min to its max when it ran more than once (`--repeat`)."""

from __future__ import annotations

from pathlib import Path

from cbcore.benchmarks.report import peer_label


def _bars(peers: list[dict], key: str) -> tuple[list[float], list[list[float]] | None]:
    """Medians, and the (below, above) distances to min and max for matplotlib's `xerr` (None when all ran once)."""
    medians = [p[key] for p in peers]
    if all(p.get("runs", 1) <= 1 or f"{key}_min" not in p for p in peers):
        return medians, None
    below = [p[key] - p.get(f"{key}_min", p[key]) for p in peers]
    above = [p.get(f"{key}_max", p[key]) - p[key] for p in peers]
    return medians, [below, above]


def write_chart(record: dict, path: Path) -> Path | None:
    """Bar charts of generated tok/s and peak memory per peer (PNG); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib is not installed: no chart (pip install matplotlib)")
        return None
    peers = [p for p in record["peers"] if "tok_per_s" in p]  # one entry per peer: --peers names each once
    labels = [peer_label(p).replace(", ", ",\n").replace(" (", "\n(") for p in peers]
    colors = ["tab:green" if p["peer"].startswith("cbcore") else "tab:gray" for p in peers]
    positions = list(range(len(peers)))
    fig, (ax_speed, ax_memory) = plt.subplots(1, 2, figsize=(13, 0.6 * len(peers) + 2))
    for ax, key, xlabel in (
        (ax_speed, "tok_per_s", "generated tokens / s (higher is better)"),
        (ax_memory, "peak_rss_mib", "peak RSS, MiB (lower is better)"),
    ):
        medians, spread = _bars(peers, key)
        ax.barh(positions, medians, color=colors, xerr=spread, capsize=4 if spread else 0, ecolor="black")
        ax.set_yticks(positions, labels if ax is ax_speed else [""] * len(peers))
        ax.set_xlabel(xlabel)
        ax.invert_yaxis()
        ends = [m + (spread[1][i] if spread else 0) for i, m in enumerate(medians)]
        for y, (median, end) in enumerate(zip(medians, ends)):
            ax.annotate(f" {median:.0f}", (end, y), va="center", fontsize=8)
        ax.set_xlim(0, max(ends, default=1) * 1.15 or 1)
    w = record["workload"]
    repeat = record.get("settings", {}).get("repeat", 1)
    runs = f"; median of {repeat} interleaved runs, bars min-max" if repeat > 1 else ""
    fig.suptitle(
        f"{w['name']} {w['description']}: {w['num_requests']} requests, {w['length_distribution']}; "
        f"{record['model']['name']} {record['model']['dtype']}; {record['machine']['cpu']}, "
        f"{record['machine']['cores']} cores{runs}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
