"""A bounded load test of `python -m cbcore serve` on loopback: streaming clients, early disconnects, bad requests.

Starts the server in a subprocess (the default model unless --model), then runs --requests requests from
--concurrency streaming clients: every 4th one disconnects after its first few chunks, every 16th is invalid (must
get a 400). Checks that every valid request gets a complete stream (`data: [DONE]`) or a clean error, that nothing
hangs (every request has a deadline), and that afterwards no cache block is referenced (`/metrics`). Reports TTFT
p50 / p99, inter-chunk latency, generated tokens per second, and writes a JSON record and a markdown table.

    .venv/bin/python bench/serve_load.py --requests 64 --concurrency 16 --max-tokens 32 --repeat 3 --out bench/results

With --repeat N the whole load runs N times, each against a fresh server; the table gives each figure's median with
its min-max, the JSON every run.
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
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the default model)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--repeat", type=int, default=1, help="runs of the whole load, each on a fresh server")
    parser.add_argument("--out", type=Path, default=None, help="folder for serve_load.json / serve_load.md")
    parser.add_argument("server_args", nargs="*", help="extra `cbcore serve` options (after --)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    runs = [_run_once(args) for _ in range(args.repeat)]
    if any(run is None for run in runs):
        return 1
    record = {
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
    }
    print(json.dumps(record, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serve_load.json").write_text(json.dumps(record, indent=2) + "\n")
        (args.out / "serve_load.md").write_text(_table(record))
    return 0 if all(_run_ok(run) for run in runs) else 1


# The figures each run reports, summarised over the runs as median (min-max).
_FIGURES = ("wall_s", "ttft_p50_s", "ttft_p99_s", "inter_chunk_p50_s", "inter_chunk_p99_s", "engine_tokens_per_s")


def _run_ok(run: dict) -> bool:
    return (all(run["complete"][kind] == run["counts"][kind] for kind in run["counts"])
            and run["blocks_used_after"] == 0 and run["server_exit_status"] == 0)


def _table(record: dict) -> str:
    def figure(name: str) -> str:
        return f"{record['median'][name]:g} ({record['min'][name]:g}-{record['max'][name]:g})"

    runs = record["runs"]
    answered = " / ".join(f"{sum(r['complete'][k] for r in runs)}/{sum(r['counts'][k] for r in runs)}"
                          for k in ("full", "disconnect", "invalid"))
    blocks = max(r["blocks_used_after"] for r in runs)
    exits = sorted({str(r["server_exit_status"]) for r in runs})
    rows = [
        "| runs | answered as expected, all runs (full / disconnecting / invalid) | wall s | TTFT p50 s | TTFT p99 s | "
        "inter-chunk p50 s | inter-chunk p99 s | engine tok/s | blocks used after (max) | exit |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {record['repeat']} | {answered} | {figure('wall_s')} | {figure('ttft_p50_s')} | {figure('ttft_p99_s')} | "
        f"{figure('inter_chunk_p50_s')} | {figure('inter_chunk_p99_s')} | {figure('engine_tokens_per_s')} | "
        f"{blocks:g} | {', '.join(exits)} |",
    ]
    return (f"# `cbcore serve` under load\n\n{record['model']}; {record['machine']['cores']} cores "
            f"({record['machine']['cpu']}); {record['concurrency']} concurrent streaming clients, "
            f"{record['requests']} requests, max_tokens {record['max_tokens']}; {record['workload']}. Each figure: "
            f"the median of {record['repeat']} runs (min-max), each on a fresh server. No peer: `vllm serve` needs "
            "bench/.vllm-venv, which this run did not have.\n\n" + "\n".join(rows)
            + f"\n\nReproduce: `.venv/bin/python {record['command']}`\n")


def _run_once(args) -> dict | None:
    """One whole load against a fresh server: its figures, or None when the server did not start."""
    random.seed(0)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "cbcore", "serve", "--port", str(port), "--served-model-name", "served",
               "--log-level", "warning", *(["--model", args.model] if args.model else []), *args.server_args]
    server = subprocess.Popen(command, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                print(f"the server exited with {server.returncode}", file=sys.stderr)
                return None
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                print("the server did not start within 300 s", file=sys.stderr)
                return None
            time.sleep(0.2)
        results, wall = asyncio.run(_load(url, args))
        deadline = time.monotonic() + 30
        while True:  # the cancelled requests' blocks are freed within a step or two
            after = _metrics(url)
            if after.get("cbcore_cache_blocks_used") == 0 and after.get("cbcore_requests_running") == 0:
                break
            if time.monotonic() > deadline:
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
    return {
        "wall_s": round(wall, 2),
        "complete": {kind: sum(r["ok"] for r in rs) for kind, rs in by_kind.items()},
        "counts": {kind: len(rs) for kind, rs in by_kind.items()},
        "errors": [r.get("error") for r in results if not r["ok"]],
        "ttft_p50_s": round(_percentile(ttfts, 0.5), 4), "ttft_p99_s": round(_percentile(ttfts, 0.99), 4),
        "inter_chunk_p50_s": round(_percentile(gaps, 0.5), 4), "inter_chunk_p99_s": round(_percentile(gaps, 0.99), 4),
        "generated_tokens_full_requests": sum(r.get("completion_tokens", 0) for r in by_kind["full"]),
        "engine_generated_tokens": after.get("cbcore_engine_generated_tokens"),
        "engine_tokens_per_s": round((after.get("cbcore_engine_generated_tokens") or 0) / wall, 1),
        "blocks_used_after": after.get("cbcore_cache_blocks_used"),
        "server_exit_status": exit_status,
    }


if __name__ == "__main__":
    sys.exit(main())
