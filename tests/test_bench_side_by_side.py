"""`python -m cbcore bench` end to end on a shrunken W1: every peer process runs, tokens are compared with the
per-prompt reference, and the record, chart and summary are written with the facts beside the numbers."""

from __future__ import annotations

import json

import pytest

from cbcore import cli


@pytest.mark.slow
def test_bench_runs_peers_side_by_side_and_records_everything(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("CBCORE_BENCH_CACHE", str(tmp_path / "models"))
    out = tmp_path / "results"
    argv = [
        "bench", "--workload", "W1", "--limit-requests", "3", "--max-new-tokens", "5",
        "--peers", "reference,cbcore,generate,vllm", "--vllm-python", str(tmp_path / "no-venv" / "python"),
        "--out", str(out),
    ]
    assert cli.main(argv) == 0
    record = json.loads((out / "side_by_side_W1_float32.json").read_text())
    assert record["command"].startswith("python -m cbcore bench --workload W1")
    assert record["workload"]["num_requests"] == 3 and record["workload"]["max_new_tokens"] == 5
    assert record["machine"]["cores"] >= 1 and record["model"]["dtype"] == "float32"
    peers = {p["peer"]: p for p in record["peers"]}
    assert "no vLLM venv" in peers["vllm"]["skipped"]
    for name in ("reference", "cbcore", "generate"):
        peer = peers[name]
        assert peer["generated_tokens"] == 15
        assert (peer["agree"], peer["agree_of"]) == (3, 3), f"{name} disagrees with model.generate"
        assert peer["peak_rss_mib"] > 0 and peer["ttft_median_s"] > 0 and peer["itl_median_s"] > 0
    prompt_tokens = record["workload"]["prompt_tokens"]
    assert peers["cbcore"]["prefilled_tokens"] == prompt_tokens == peers["reference"]["prefilled_tokens"]
    assert peers["generate"]["prefilled_tokens"] >= prompt_tokens  # padding counts
    assert "cbcore_over_generate" in record["cbcore_throughput_ratios"]
    summary = (out / "side_by_side.md").read_text()
    assert "side_by_side_W1_float32" in summary and "cbcore generate_batch" in summary
    printed = capsys.readouterr().out
    assert "| cbcore generate_batch |" in printed
