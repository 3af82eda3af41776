"""What tensor parallelism costs the step on top of the forward: the driver's plan sent to the other ranks
(cbcore/distributed/channel.py), measured alone on two CPU processes over gloo (the channel's own backend, whatever
the model's), for decode steps of 64 and 1024 running requests (and a heartbeat: the header alone).

Per step: the plan encoded on the driver (wire.encode_plan), one exchange (the header all-reduce of 2 + ranks int64
and the plan's broadcast), the plan decoded on the other rank (wire.decode_plan). Each request decodes one token with
a block table of ceil(context / page_size) blocks. Medians over 200 steps after 20 warm-up steps, 3 runs.

With `--compare-inline`, each row is also run with the payload always broadcast on its own (the channel's
`MAX_INLINE` set to 0: two collectives per step), interleaved with the default (one collective when the plan fits
the header's inline room, at most `MAX_INLINE` ints).

    python bench/tp_broadcast.py [--context 512] [--page-size 16] [--steps 200] [--compare-inline]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cbcore.distributed import channel as channel_module
from cbcore.distributed.channel import Kind, StepChannel
from cbcore.distributed.group import TensorParallelGroup
from cbcore.distributed.wire import decode_plan, encode_plan
from cbcore.plan import PlannedRequest, StepPlan

RUNNING = (0, 64, 1024)  # 0: a heartbeat (the header alone), the floor of any exchange
WARMUP = 20


def decode_step(num_requests: int, context: int, page_size: int) -> StepPlan:
    """A decode step: every request runs one token at position `context` over its block table."""
    blocks = -(-(context + 1) // page_size)
    return StepPlan([PlannedRequest(f"req_{i}", [i % 1000 + 1], context, list(range(i * blocks, (i + 1) * blocks)),
                                    True) for i in range(num_requests)])


DEFAULT_MAX_INLINE = channel_module.MAX_INLINE  # the channel's own threshold: inline up to it, then a broadcast


def _rank(rank: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    group = TensorParallelGroup([0, 1], rank, cpu_group_timeout=60)
    modes = ("inline", "broadcast") if args.compare_inline else ("inline",)
    for num_requests in RUNNING:
        plan = decode_step(num_requests, args.context, args.page_size)
        for run, mode in [(run, mode) for run in range(3) for mode in modes]:
            channel_module.MAX_INLINE = DEFAULT_MAX_INLINE if mode == "inline" else 0
            channel = StepChannel(group)  # a fresh inline room: the warm-up steps size it
            encode_us, exchange_us, decode_us, sizes = [], [], [], []
            for step in range(WARMUP + args.steps):
                dist.barrier(group=group.cpu_group)  # both ranks start the step together: the exchange alone
                started = time.perf_counter()
                payload = encode_plan(plan) if rank == 0 and num_requests else None
                encoded = time.perf_counter()
                received = channel.exchange(Kind.STEP if num_requests else Kind.HEARTBEAT, payload)
                exchanged = time.perf_counter()
                if rank != 0 and num_requests:
                    decoded_plan = decode_plan(received.payload)
                    assert len(decoded_plan.requests) == num_requests
                decoded = time.perf_counter()
                if step >= WARMUP:
                    encode_us.append((encoded - started) * 1e6)
                    exchange_us.append((exchanged - encoded) * 1e6)
                    decode_us.append((decoded - exchanged) * 1e6)
                    sizes.append(8 * len(received.payload or []))
            results[(rank, num_requests, run, mode)] = (statistics.median(encode_us), statistics.median(exchange_us),
                                                        statistics.median(decode_us), sizes[0])
    group.destroy()
    dist.destroy_process_group()


def main() -> None:
    """Print a Markdown table: per step, bytes sent and µs spent (driver: encode + exchange; other rank: exchange
    + decode)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=512, help="tokens each running request has computed")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compare-inline", action="store_true", help="also run with the payload always broadcast")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(port, args, results), nprocs=2, join=True)
    print(f"context {args.context} tokens, page_size {args.page_size}, {args.steps} steps per run, medians; "
          "three runs per row")
    print("| running requests | payload | plan bytes | driver encode µs | exchange µs (driver) | exchange µs (rank 1) "
          "| rank 1 decode µs | driver total µs |")
    print("|---|---|---|---|---|---|---|---|")
    modes = ("inline", "broadcast") if args.compare_inline else ("inline",)
    for num_requests in RUNNING:
        for run, mode in [(run, mode) for run in range(3) for mode in modes]:
            enc, exch, _, size = results[(0, num_requests, run, mode)]
            _, exch1, dec, _ = results[(1, num_requests, run, mode)]
            print(f"| {num_requests} (run {run + 1}) | {mode} | {size:,} | {enc:.0f} | {exch:.0f} | {exch1:.0f} "
                  f"| {dec:.0f} | {enc + exch:.0f} |")


if __name__ == "__main__":
    main()
