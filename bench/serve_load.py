"""A bounded load test of `python -m cbcore serve` on loopback (and of `vllm serve` on the same load, side by side):
streaming clients, early disconnects, bad requests.

Starts the server in a subprocess (the default model unless --model), then runs --requests requests from
--concurrency streaming clients: every 4th one disconnects after its first few chunks, every 16th is invalid (must
get a 400). Checks that every valid request gets a complete stream (`data: [DONE]`) or a clean error, that nothing
hangs (every request has a deadline), and that afterwards no cache block is referenced and nothing runs (`/metrics`).
Reports TTFT p50 / p99, inter-chunk latency, generated tokens per second, and writes a JSON record and a markdown
table.

    .venv/bin/python bench/serve_load.py --requests 64 --concurrency 16 --max-tokens 32 --repeat 3 --out bench/results
    .venv/bin/python bench/serve_load.py --servers cbcore,vllm ...   # with bench/.vllm-venv (bench/setup_vllm.sh)

With --repeat N the whole load runs N times per server, each against a fresh server, the servers interleaved
(cbcore, vllm, cbcore, vllm, ...); the table gives each figure's median with its min-max, the JSON every run, and
cbcore's ratios over vLLM. vLLM serves the same model folder in float32 with `VLLM_CPU_KVCACHE_SPACE` set explicitly
(--vllm-kv-cache-gib, recorded) and `VLLM_CPU_OMP_THREADS_BIND` over every core; its token count and leftover state
come from its own `/metrics` (`vllm:generation_tokens_total`, `vllm:kv_cache_usage_perc`, `vllm:num_requests_running`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cbcore.benchmarks.machine import cpu_model

REPO = Path(__file__).resolve().parents[1]
TOPICS = ("the sea", "a hash table", "sleep", "Paris", "prime numbers", "a bicycle", "rain", "chess")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _one(http: httpx.AsyncClient, index: int, args, results: list[dict]) -> None:
    kind = "invalid" if index % 16 == 15 else "disconnect" if index % 4 == 3 else "full"
    body = {"model": "served", "messages": [{"role": "user", "content": f"Tell me about {TOPICS[index % 8]}."}],
            "max_tokens": args.max_tokens, "temperature": 0.8, "stream": True,
            "stream_options": {"include_usage": True}}
    if kind == "invalid":
        body["temperature"] = -1
    record = {"index": index, "kind": kind, "ok": False}
    started = time.perf_counter()
    try:
        async with asyncio.timeout(args.request_timeout):
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                record["status"] = response.status_code
                if kind == "invalid":
                    await response.aread()
                    record["ok"] = response.status_code == 400 and "error" in response.json()
                    return
                chunks, last = 0, None
                stamps = []
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.perf_counter()
                    data = line[6:]
                    if data == "[DONE]":
                        record["done"] = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        record["error"] = event["error"]["message"]
                        break
                    if event["choices"] and event["choices"][0]["delta"].get("content"):
                        if "ttft" not in record:
                            record["ttft"] = now - started
                        stamps.append(now)
                        chunks += 1
                    if event.get("usage"):
                        record["completion_tokens"] = event["usage"]["completion_tokens"]
                    last = event
                    if kind == "disconnect" and chunks >= 3:
                        break  # leaving the `async with` closes the connection: the server must cancel
                record["gaps"] = [b - a for a, b in zip(stamps, stamps[1:])]
                record["ok"] = (kind == "disconnect") or bool(record.get("done")) and last is not None
    except TimeoutError:
        record["error"] = f"no answer within {args.request_timeout} s"
    except httpx.HTTPError as error:
        record["error"] = repr(error)
    finally:
        record["latency"] = time.perf_counter() - started
        results.append(record)


async def _load(url: str, args) -> tuple[list[dict], float]:
    results: list[dict] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(args.requests):
        queue.put_nowait(index)

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout) as http:
            while not queue.empty():
                await _one(http, queue.get_nowait(), args, results)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return results, time.perf_counter() - started


def _metrics(url: str) -> dict[str, float]:
    """Prometheus samples by name (labels dropped, values of one name summed)."""
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            try:
                values[name] = values.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return values


class CbcoreServer:
    """`python -m cbcore serve` and the names of its metrics."""

    name = "cbcore"
    generated = "cbcore_engine_generated_tokens"

    def command(self, args, port: int) -> tuple[list[str], dict[str, str]]:
        """The server's command line and the environment it adds."""
        return ([sys.executable, "-m", "cbcore", "serve", "--port", str(port), "--served-model-name", "served",
                 "--log-level", "warning", *(["--model", args.model] if args.model else []), *args.server_args],
                {"PYTHONPATH": str(REPO)})

    @staticmethod
    def idle(metrics: dict[str, float]) -> bool:
        """Whether the server holds nothing: no request running, no cache held."""
        return metrics.get("cbcore_cache_blocks_used") == 0 and metrics.get("cbcore_requests_running") == 0

    @staticmethod
    def blocks_used(metrics: dict[str, float]) -> float | None:
        """The cache it still holds (0: none), or None when its metrics do not say."""
        return metrics.get("cbcore_cache_blocks_used")


class VllmServer:
    """vLLM-CPU's OpenAI server from its own venv, on the same model folder."""

    name = "vllm"
    generated = "vllm:generation_tokens_total"

    def command(self, args, port: int) -> tuple[list[str], dict[str, str]]:
        from cbcore.benchmarks.models import model_folder

        folder = args.model or str(model_folder("default"))
        # What `vllm serve` runs, through its module: the `vllm` command looks up package metadata named vllm, and
        # this install's is vllm-cpu.
        return ([str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                 "--served-model-name", "served", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
                 "--uvicorn-log-level", "warning"],
                {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_cache_gib),
                 "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"})

    @staticmethod
    def idle(metrics: dict[str, float]) -> bool:
        return metrics.get("vllm:num_requests_running") == 0 and metrics.get("vllm:kv_cache_usage_perc") == 0

    @staticmethod
    def blocks_used(metrics: dict[str, float]) -> float | None:
        return metrics.get("vllm:kv_cache_usage_perc")  # a share of its blocks; 0 when nothing is held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the default model)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--repeat", type=int, default=1, help="runs of the whole load, each on a fresh server")
    parser.add_argument("--out", type=Path, default=None, help="folder for serve_load.json / serve_load.md")
    parser.add_argument("--servers", default="cbcore", help="comma-separated: cbcore, vllm (default: cbcore)")
    parser.add_argument("--vllm-python", type=Path, default=REPO / "bench" / ".vllm-venv" / "bin" / "python")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE, whole GiB (recorded)")
    parser.add_argument("server_args", nargs="*", help="extra `cbcore serve` options (after --)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    known = {"cbcore": CbcoreServer(), "vllm": VllmServer()}
    names = [name.strip() for name in args.servers.split(",") if name.strip()]
    if not names or any(name not in known for name in names):
        parser.error(f"--servers takes a comma-separated list of {sorted(known)}")
    if "vllm" in names and not args.vllm_python.exists():
        parser.error(f"--servers vllm needs {args.vllm_python} (run bench/setup_vllm.sh)")
    runs_by_server: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.repeat):
        for name in names:  # interleaved: each server's runs spread over the same stretch of time
            run = _run_once(args, known[name])
            if run is None:
                return 1
            runs_by_server[name].append(run)
    records = {name: _summary(runs, args, argv, name) for name, runs in runs_by_server.items()}
    print(json.dumps(records, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serve_load.json").write_text(json.dumps(records, indent=2) + "\n")
        (args.out / "serve_load.md").write_text(_table(records))
    return 0 if all(_run_ok(run, name) for name, runs in runs_by_server.items() for run in runs) else 1


def _summary(runs: list[dict], args, argv, server: str) -> dict:
    """One server's record: the setting, each figure's median / min / max, every run."""
    return {
        "server": server,
        "command": " ".join(["bench/serve_load.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
        "model": args.model or "SmolLM2-135M-Instruct (default model, float32)",
        "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "workload": "chat, 8 short prompts (~35-40 tokens with the template), temperature 0.8, streaming; "
                    "every 4th client disconnects after 3 chunks, every 16th request is invalid",
        "repeat": args.repeat,
        "median": {name: statistics.median(run[name] for run in runs) for name in _FIGURES},
        "min": {name: min(run[name] for run in runs) for name in _FIGURES},
        "max": {name: max(run[name] for run in runs) for name in _FIGURES},
        "runs": runs,
        **({"vllm_env": {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_cache_gib),
                         "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}} if server == "vllm" else {}),
    }


# The figures each run reports, summarised over the runs as median (min-max).
_FIGURES = ("wall_s", "ttft_p50_s", "ttft_p99_s", "inter_chunk_p50_s", "inter_chunk_p99_s", "engine_tokens_per_s")


def _run_ok(run: dict, server: str) -> bool:
    """Every request answered as expected and nothing held afterwards (and, for cbcore, a clean exit)."""
    return (all(run["complete"][kind] == run["counts"][kind] for kind in run["counts"])
            and run["blocks_used_after"] == 0 and (server != "cbcore" or run["server_exit_status"] == 0))


def _table(records: dict[str, dict]) -> str:
    """The markdown table: one row per server, then cbcore's ratios over vLLM when both ran."""
    first = next(iter(records.values()))

    def figure(record: dict, name: str) -> str:
        return f"{record['median'][name]:g} ({record['min'][name]:g}-{record['max'][name]:g})"

    rows = [
        "| server | runs | answered as expected, all runs (full / disconnecting / invalid) | wall s | TTFT p50 s | "
        "TTFT p99 s | inter-chunk p50 s | inter-chunk p99 s | engine tok/s | cache held after (max) | exit |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, record in records.items():
        runs = record["runs"]
        answered = " / ".join(f"{sum(r['complete'][k] for r in runs)}/{sum(r['counts'][k] for r in runs)}"
                              for k in ("full", "disconnect", "invalid"))
        held = max((r["blocks_used_after"] or 0) for r in runs)
        exits = sorted({str(r["server_exit_status"]) for r in runs})
        label = "cbcore serve" if name == "cbcore" else "vllm serve (vLLM-CPU 0.32, both cores)"
        rows.append(
            f"| {label} | {record['repeat']} | {answered} | {figure(record, 'wall_s')} | "
            f"{figure(record, 'ttft_p50_s')} | {figure(record, 'ttft_p99_s')} | {figure(record, 'inter_chunk_p50_s')} | "
            f"{figure(record, 'inter_chunk_p99_s')} | {figure(record, 'engine_tokens_per_s')} | {held:g} | "
            f"{', '.join(exits)} |")
    text = (f"# Serving under load: `cbcore serve`{' and `vllm serve`' if 'vllm' in records else ''}\n\n"
            f"{first['model']}; {first['machine']['cores']} cores ({first['machine']['cpu']}); "
            f"{first['concurrency']} concurrent streaming clients, {first['requests']} requests, max_tokens "
            f"{first['max_tokens']}; {first['workload']}. Each figure: the median of {first['repeat']} runs "
            "(min-max), each on a fresh server, the servers interleaved. `cache held after`: cbcore's blocks still "
            "used, vLLM's KV-cache usage share, once the load is over (0: nothing leaked).\n\n" + "\n".join(rows))
    if "cbcore" in records and "vllm" in records:
        ours, theirs = records["cbcore"]["median"], records["vllm"]["median"]
        text += (f"\n\ncbcore over vLLM (ratios of medians): engine tok/s "
                 f"{ours['engine_tokens_per_s'] / theirs['engine_tokens_per_s']:.2f}x, wall time "
                 f"{ours['wall_s'] / theirs['wall_s']:.2f}x, TTFT p50 {ours['ttft_p50_s'] / theirs['ttft_p50_s']:.2f}x, "
                 f"inter-chunk p50 {ours['inter_chunk_p50_s'] / theirs['inter_chunk_p50_s']:.2f}x (below 1 is "
                 "better for times). vLLM's KV cache: VLLM_CPU_KVCACHE_SPACE="
                 f"{records['vllm']['vllm_env']['VLLM_CPU_KVCACHE_SPACE']} GiB.")
    return text + f"\n\nReproduce: `.venv/bin/python {first['command']}`\n"


def _run_once(args, server_kind) -> dict | None:
    """One whole load against a fresh server: its figures, or None when the server did not start."""
    random.seed(0)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command, env = server_kind.command(args, port)
    server = subprocess.Popen(command, cwd=REPO, env=dict(os.environ, **env))
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                print(f"the {server_kind.name} server exited with {server.returncode}", file=sys.stderr)
                return None
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                print(f"the {server_kind.name} server did not start within 300 s", file=sys.stderr)
                return None
            time.sleep(0.2)
        before = _metrics(url)
        results, wall = asyncio.run(_load(url, args))
        deadline = time.monotonic() + 30
        while True:  # the cancelled requests' blocks are freed within a step or two
            after = _metrics(url)
            if server_kind.idle(after) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        server.terminate()
        try:
            exit_status = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            exit_status = "killed after 60 s"

    by_kind = {kind: [r for r in results if r["kind"] == kind] for kind in ("full", "disconnect", "invalid")}
    ttfts = [r["ttft"] for r in results if "ttft" in r]
    gaps = [g for r in results for g in r.get("gaps", [])]
    generated = (after.get(server_kind.generated) or 0) - (before.get(server_kind.generated) or 0)
    return {
        "wall_s": round(wall, 2),
        "complete": {kind: sum(r["ok"] for r in rs) for kind, rs in by_kind.items()},
        "counts": {kind: len(rs) for kind, rs in by_kind.items()},
        "errors": [r.get("error") for r in results if not r["ok"]],
        "ttft_p50_s": round(_percentile(ttfts, 0.5), 4), "ttft_p99_s": round(_percentile(ttfts, 0.99), 4),
        "inter_chunk_p50_s": round(_percentile(gaps, 0.5), 4), "inter_chunk_p99_s": round(_percentile(gaps, 0.99), 4),
        "generated_tokens_full_requests": sum(r.get("completion_tokens", 0) for r in by_kind["full"]),
        "engine_generated_tokens": generated,
        "engine_tokens_per_s": round(generated / wall, 1),
        "blocks_used_after": server_kind.blocks_used(after),
        "server_exit_status": exit_status,
    }


if __name__ == "__main__":
    sys.exit(main())
