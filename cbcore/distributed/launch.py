"""`torchrun --nproc-per-node N -m cbcore generate|serve ...`: the command line under tensor parallelism.

torchrun starts one process per rank with RANK / WORLD_SIZE / LOCAL_RANK set. Every rank loads the model with
transformers' tensor-parallel plan (`DistributedConfig(tp_plan="auto")`, the size taken from WORLD_SIZE; transformers
initializes the process group: NCCL on GPUs, gloo on CPUs, and binds each rank to its device) and builds the same
manager. The driver (rank 0) prints the outputs (`generate`) or runs the HTTP server (`serve`); the other ranks serve
its steps and print nothing.
"""

from __future__ import annotations

import os
import signal
import time


def torchrun_world_size() -> int:
    """How many ranks torchrun started (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_driver_process() -> bool:
    """Whether this process is rank 0 (the one that prints, and the tensor-parallel driver of a single group)."""
    return int(os.environ.get("RANK", "0")) == 0


def tensor_parallel_load_kwargs(device: str | None) -> dict:
    """`from_pretrained` arguments that shard the model over torchrun's ranks. `device` (the command line's
    --device) must be what transformers will use: the accelerator when there is one, else the CPU."""
    import torch
    from transformers import DistributedConfig

    accelerator = torch._C._get_accelerator().type
    if device is not None and device.split(":")[0] != accelerator:
        raise ValueError(
            f"--device {device}: under torchrun transformers shards the model over this machine's {accelerator} "
            f"devices (each rank on its own); drop --device"
        )
    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def serve_follower(manager) -> int:
    """A non-driver rank of `cbcore serve`: run the driver's steps until the driver stops the manager (its server
    shut down), or the group fails. Signals are the driver's to act on (torchrun forwards them to every rank): here
    they are ignored, and the loop ends when the driver's does or within cpu_group_timeout of losing it."""
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while manager.is_running():
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        manager.destroy()
    return 1 if manager.background_thread_status.fatal_error is not None else 0
