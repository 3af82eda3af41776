"""`python -m cbcore bench`: end to end on a shrunken W1 (every peer process runs, tokens are compared with the
per-prompt reference, the record, chart and summary are written with the facts beside the numbers, `--repeat`
interleaves the peers), and the pieces that need no peer process: medians and min-max over runs, one table row and
one bar per peer, the vLLM settings, the command-line checks."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cbcore import cli
from cbcore.benchmarks import chart, locations, report, side_by_side
from cbcore.benchmarks.workloads import build_workload


@pytest.mark.slow
def test_bench_runs_peers_side_by_side_and_records_everything(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("CBCORE_BENCH_CACHE", str(tmp_path / "unused"))
    out = tmp_path / "results"
    argv = [
        "bench", "--workload", "W1", "--limit-requests", "3", "--max-new-tokens", "5", "--repeat", "2",
        "--peers", "reference,cbcore,generate,vllm", "--vllm-python", str(tmp_path / "no-venv" / "python"),
        "--cache-dir", str(tmp_path / "models"), "--out", str(out),
    ]
    assert cli.main(argv) == 0
    assert (tmp_path / "models").is_dir() and not (tmp_path / "unused").exists()  # --cache-dir wins
    record = json.loads((out / "side_by_side_W1_float32.json").read_text())
    assert record["command"].startswith("python -m cbcore bench --workload W1")
    assert record["workload"]["num_requests"] == 3 and record["workload"]["max_new_tokens"] == 5
    assert record["machine"]["cores"] >= 1 and record["model"]["dtype"] == "float32"
    assert record["settings"]["repeat"] == 2 and record["settings"]["vllm_kv_cache_gib"] == 2
    # Interleaved: round 1 runs every peer once, then round 2 does.
    assert [(r["round"], r["peer"]) for r in record["runs"]] == [
        (1, "reference"), (1, "cbcore"), (1, "generate"), (2, "reference"), (2, "cbcore"), (2, "generate"),
    ]
    peers = {p["peer"]: p for p in record["peers"]}
    assert list(peers) == ["reference", "cbcore", "generate", "vllm"]
    assert "no vLLM python at" in peers["vllm"]["skipped"] and "setup_vllm.sh" in peers["vllm"]["skipped"]
    for name in ("reference", "cbcore", "generate"):
        peer = peers[name]
        assert peer["runs"] == 2 and peer["generated_tokens"] == 15
        assert (peer["agree"], peer["agree_of"]) == (3, 3), f"{name} disagrees with model.generate"
        assert peer["peak_rss_mib"] > 0 and peer["ttft_median_s"] > 0 and peer["itl_median_s"] > 0
        assert peer["tok_per_s_min"] <= peer["tok_per_s"] <= peer["tok_per_s_max"]
    prompt_tokens = record["workload"]["prompt_tokens"]
    assert peers["cbcore"]["prefilled_tokens"] == prompt_tokens == peers["reference"]["prefilled_tokens"]
    assert peers["generate"]["prefilled_tokens"] >= prompt_tokens  # padding counts
    ratio = record["cbcore_throughput_ratios"]["cbcore_over_generate"]
    assert ratio == pytest.approx(peers["cbcore"]["tok_per_s"] / peers["generate"]["tok_per_s"])
    summary = (out / "side_by_side.md").read_text()
    assert "side_by_side_W1_float32" in summary and "cbcore generate_batch" in summary
    printed = capsys.readouterr().out
    assert "| cbcore generate_batch |" in printed and "Median of 2 interleaved runs" in printed
    assert "skipping vllm: no vLLM python at" in printed


def _raw(peer: str, round_: int, wall: float, tokens: list[list[int]], rss_mib: float = 100.0) -> dict:
    """A peer's raw result as its process writes it: one token every 10 ms per request."""
    times = [[0.01 * (i + 1) for i in range(len(t))] for t in tokens]
    return {
        "peer": peer, "round": round_, "tokens": tokens, "token_times": times, "wall_s": wall,
        "prefilled_tokens": 12, "peak_rss_bytes": int(rss_mib * 2**20),
    }


@pytest.fixture
def three_rounds() -> dict:
    """cbcore and generate, three rounds each, cbcore's walls 1, 2 and 4 s, generate's 4, 8 and 5 s; vLLM skipped."""
    workload = build_workload("W1", limit_requests=2, max_new_tokens=4)
    tokens = [[1, 2, 3, 4], [5, 6, 7, 8]]
    results = []
    for round_, (fast, slow) in enumerate([(1.0, 4.0), (2.0, 8.0), (4.0, 5.0)], start=1):
        results += [_raw("cbcore", round_, fast, tokens), _raw("generate", round_, slow, tokens, rss_mib=300.0)]
    results.append({"peer": "vllm", "skipped": "no vLLM python at /x; build it"})
    settings = {"repeat": 3, "vllm_kv_cache_gib": 2}
    return report.build_record(
        workload, "float32", ["cbcore", "generate", "vllm"], results, {"cpu": "cpu", "cores": 2}, "cmd", "/m", settings
    )


def test_each_peer_gets_its_median_and_min_max_over_rounds(three_rounds) -> None:
    cbcore = next(p for p in three_rounds["peers"] if p["peer"] == "cbcore")
    assert cbcore["runs"] == 3 and cbcore["generated_tokens"] == 8
    assert (cbcore["tok_per_s_min"], cbcore["tok_per_s"], cbcore["tok_per_s_max"]) == (2.0, 4.0, 8.0)
    assert (cbcore["wall_s_min"], cbcore["wall_s"], cbcore["wall_s_max"]) == (1.0, 2.0, 4.0)
    assert len(three_rounds["runs"]) == 6  # every run is kept


def test_ratios_are_ratios_of_medians(three_rounds) -> None:
    # cbcore's median 8 / 2 s = 4 tok/s; generate's median 8 / 5 s = 1.6 tok/s.
    assert three_rounds["cbcore_throughput_ratios"]["cbcore_over_generate"] == pytest.approx(4.0 / 1.6)


def test_each_round_has_its_own_ratio_in_the_record_and_the_table(three_rounds) -> None:
    # Round by round: walls 1 / 4, 2 / 8 and 4 / 5 s for the same tokens.
    rounds = three_rounds["cbcore_throughput_ratios_by_round"]["cbcore_over_generate"]
    assert rounds == pytest.approx([4.0, 4.0, 1.25])
    assert "cbcore tok/s over: generate 2.50x (rounds 4.00 / 4.00 / 1.25)" in report.format_table(three_rounds)


def test_a_cbcore_variant_gets_ratios_under_its_own_name() -> None:
    workload = build_workload("W1", limit_requests=2, max_new_tokens=4)
    tokens = [[1, 2, 3, 4], [5, 6, 7, 8]]
    results = [_raw("cbcore-compiled", 1, 1.0, tokens), _raw("vllm-2c", 1, 2.0, tokens)]
    record = report.build_record(workload, "float32", ["cbcore-compiled", "vllm-2c"], results,
                                 {"cpu": "cpu", "cores": 2}, "cmd", "/m", {"repeat": 1})
    assert record["cbcore_throughput_ratios"] == {"cbcore-compiled_over_vllm-2c": pytest.approx(2.0)}
    assert record["cbcore_throughput_ratios_by_round"] == {}  # one round: its ratio is the median's


def test_table_has_one_row_per_peer_with_min_max_and_the_vllm_footnote(three_rounds) -> None:
    table = report.format_table(three_rounds)
    rows = [line for line in table.splitlines() if line.startswith("| cbcore generate_batch |")]
    assert len(rows) == 1 and "| 4 (2–8) |" in rows[0] and "| 2.0 (1.0–4.0) |" in rows[0]
    assert "Median of 3 interleaved runs per peer" in table and "generate 2.50x" in table
    # vLLM did not run here, so no KV-cache footnote; with a vLLM row it names the size.
    assert "VLLM_CPU_KVCACHE_SPACE" not in table
    three_rounds["peers"][1]["peer"] = "vllm"
    assert "vLLM KV cache: 2 GiB (VLLM_CPU_KVCACHE_SPACE=2)." in report.format_table(three_rounds)


def test_records_from_before_repeat_still_render(three_rounds) -> None:
    old = dict(three_rounds, peers=[dict(p) for p in three_rounds["peers"]])
    del old["settings"], old["runs"]
    for p in old["peers"]:
        p.pop("runs", None)
    old["peers"][1]["peer"] = "vllm"
    table = report.format_table(old)
    assert "| 4 |" in table and "(2–8)" not in table
    assert "vLLM's automatic CPU sizing (VLLM_CPU_KVCACHE_SPACE unset)" in table


def test_chart_draws_one_bar_per_peer_with_an_error_bar(three_rounds, tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.container import BarContainer

    drawn = []
    monkeypatch.setattr(plt, "close", lambda fig: drawn.append(fig))
    assert chart.write_chart(three_rounds, tmp_path / "chart.png").exists()
    speed, _ = drawn[0].axes
    assert len(speed.patches) == 2  # cbcore and generate: three runs each, one bar each
    assert [bar.get_width() for bar in speed.patches] == [4.0, 1.6]
    (bars,) = [c for c in speed.containers if isinstance(c, BarContainer)]
    (whiskers,) = bars.errorbar.lines[2]  # one horizontal segment per bar, from the min to the max
    assert [(a[0], b[0]) for a, b in whiskers.get_segments()] == [(2.0, 8.0), (1.0, 2.0)]
    assert [label.get_text().split("\n")[0] for label in speed.get_yticklabels()] == ["cbcore generate_batch",
                                                                                     "model.generate,"]


def test_a_peer_named_twice_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--workload", "W1", "--peers", "cbcore,generate,cbcore"])
    assert exit_.value.code == 2
    assert "--peers names cbcore more than once; use --repeat N" in capsys.readouterr().err


def test_missing_vllm_python_says_how_to_get_one(tmp_path) -> None:
    message = locations.missing_vllm_python(tmp_path / "nope" / "python")
    assert f"no vLLM python at {tmp_path / 'nope' / 'python'}" in message
    assert "bench/setup_vllm.sh" in message and "--vllm-python" in message
    assert "setup_vllm.sh" in locations.missing_vllm_python(None)
    assert locations.missing_vllm_python(Path(__file__)) is None  # an existing file: the run tries it


def test_vllm_gets_the_kv_cache_size_and_its_binding(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(side_by_side, "model_folder", lambda name, cache_dir=None: tmp_path / "model")
    workload = build_workload("W1", limit_requests=2, max_new_tokens=4)
    args = argparse.Namespace(vllm_python=Path("/venv/bin/python"), vllm_kv_cache_gib=3, dtype="float32", cache_dir=None)
    command, env, _ = side_by_side.peer_command("vllm", workload, args, tmp_path, "vllm.round1")
    assert command[:2] == ["/venv/bin/python", str(side_by_side.VLLM_RUNNER)]
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_OMP_THREADS_BIND": None}
    _, env, _ = side_by_side.peer_command("vllm-2c", workload, args, tmp_path, "vllm-2c.round1")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")


def test_results_default_to_the_checkouts_bench_results() -> None:
    # This suite runs from the source checkout; an installed copy defaults to ./bench-results/ (the packaging test).
    assert locations.checkout_bench_dir() == Path(__file__).resolve().parents[1] / "bench"
    assert side_by_side.build_parser().parse_args(["--workload", "W1"]).out == locations.checkout_bench_dir() / "results"


def test_last_level_cache_is_the_largest_cache_linux_reports(tmp_path) -> None:
    from cbcore.benchmarks.machine import last_level_cache_bytes

    for name, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "491520K"), ("index4", "bogus")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(size + "\n")
    (tmp_path / "index1").mkdir()  # no size file: skipped
    assert last_level_cache_bytes(tmp_path) == 480 * 2**20
    assert last_level_cache_bytes(tmp_path / "missing") is None


def test_the_cpu_is_named_with_its_family_and_model(tmp_path) -> None:
    """A VM's model name alone ("AMD EPYC") does not tell a Zen 4 (family 25) from a Zen 5 (family 26): the record
    adds both numbers from the first processor's block; without them, or without the file, the name alone."""
    from cbcore.benchmarks.machine import cpu_model

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                       "model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\n")
    assert cpu_model(cpuinfo) == "AMD EPYC (family 26, model 2)"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\n")
    assert cpu_model(cpuinfo) == "Some CPU"
    assert cpu_model(tmp_path / "missing")  # platform's answer, whatever it is
