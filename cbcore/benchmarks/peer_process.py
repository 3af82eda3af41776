"""A peer's child process: run it with its output in a log file, and sample the resident memory of its whole process
tree (vLLM's engine and worker processes included) every 20 ms to get its peak.

The sampler runs on the same cores as the peer it measures, so it must cost next to nothing. Listing a process's
descendants (`psutil.Process.children(recursive=True)`) reads every process's /proc entry; done at every sample, it
slowed the peers it measured, cbcore's two threads meeting at a barrier after every operation most of all
(docs/performance_log.md, 2026-12-06). So the tree is listed again only every `TREE_REFRESH_S` (peers start their
processes seconds before their timed part), and each sample reads only the resident size of the processes already
known."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import psutil

MEMORY_SAMPLE_S = 0.02
TREE_REFRESH_S = 0.5  # how often the sampler lists the process tree again


class PeakMemory:
    """Samples the RSS of a process and all its descendants in a thread; `peak` is the largest sum seen."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        tree: list[psutil.Process] = []
        listed = -float("inf")
        while not self._done.is_set():
            if time.monotonic() - listed >= TREE_REFRESH_S:
                try:
                    tree = [self.process] + self.process.children(recursive=True)
                except psutil.Error:
                    return  # the peer's process is gone
                listed = time.monotonic()
            total = 0
            for proc in tree:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:  # a process of the tree that ended
                    pass
            self.peak = max(self.peak, total)
            self._done.wait(MEMORY_SAMPLE_S)

    def stop(self) -> int:
        """Stop sampling; the peak RSS seen, in bytes."""
        self._done.set()
        self._thread.join()
        return self.peak


def run_child(command: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> tuple[int, int, float]:
    """Run one peer process; returns (exit status, peak RSS of its tree in bytes, seconds)."""
    started = time.perf_counter()
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
        sampler = PeakMemory(child.pid)
        status = child.wait()
        peak = sampler.stop()
    return status, peak, time.perf_counter() - started
