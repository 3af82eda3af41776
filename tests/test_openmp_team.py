"""The caller's OpenMP team is released before the loop thread starts (cbcore/openmp_team.py): the release ends the
calling thread's idle workers, `CBCORE_RELEASE_OPENMP_TEAM=0` keeps them, and `start()` releases from the thread that
called it. Thread counts are read in a fresh process, where nothing else starts or ends threads meanwhile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import cbcore
from cbcore import openmp_team

from conftest import greedy_config, tiny_model

pytestmark = pytest.mark.skipif(
    not getattr(torch._C, "has_openmp", False) or os.cpu_count() < 2, reason="needs torch on OpenMP and two CPUs"
)

# Counts this process's threads after a parallel op (the team exists), then after the release (polled: the workers
# exit on their own after the runtime tells them to).
_COUNT_THREADS = r"""
import json, os, time, torch
from cbcore import openmp_team
torch.set_num_threads(2)
count = lambda: len(os.listdir("/proc/self/task"))
before = count()
torch.ones(512, 512) @ torch.ones(512, 512)
with_team = count()
released = openmp_team.release_caller_openmp_team()
deadline = time.monotonic() + 5
while count() >= with_team and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"before": before, "with_team": with_team, "after": count(), "released": released}))
"""


def _thread_counts(release: str) -> dict:
    env = {**os.environ, openmp_team.RELEASE_ENV: release, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _COUNT_THREADS], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_release_ends_the_callers_idle_workers():
    counts = _thread_counts("1")
    assert counts["with_team"] > counts["before"], counts  # the parallel op started a worker
    assert counts["released"] is True
    assert counts["after"] == counts["before"], counts


def test_switch_off_keeps_the_team():
    counts = _thread_counts("0")
    assert counts["released"] is False
    assert counts["after"] == counts["with_team"], counts


def test_start_releases_from_the_calling_thread(monkeypatch):
    calls = []
    monkeypatch.setattr("cbcore.serving.manager.release_caller_openmp_team",
                        lambda: calls.append(threading.current_thread()))
    manager = cbcore.ContinuousBatchingManager(tiny_model("llama_gqa"), greedy_config(2),
                                               cbcore.ContinuousBatchingConfig())
    manager.start()
    try:
        # Once, from the thread that called start() (the loop's own team is the one the steps need).
        assert calls == [threading.current_thread()]
    finally:
        manager.stop(block=True, timeout=60)
