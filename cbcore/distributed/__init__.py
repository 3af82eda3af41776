"""Tensor parallelism over torch.distributed (docs/design.md, "Tensor parallelism"): one engine per rank of the
tensor-parallel group transformers loaded the model over; rank 0, the driver, takes the requests, schedules, samples and
delivers, and sends each step to the others.

| module | one job |
|---|---|
| `group.py` | `TensorParallelGroup`: the model's group, the CPU group with `cpu_group_timeout`, agreed sizes, refusals |
| `channel.py` | `StepChannel`: the exchange every message is (header of kinds and per-rank flags, payload, errors) |
| `wire.py` | a `StepPlan` / `BlockCopies` as one int64 tensor |
| `driver.py` | `DriverRunner` (every copy and forward sent first) and `DriverLink` (heartbeats, pause, start, stop) |
| `pause.py` | `pause()` across the group |
| `launch.py` | `torchrun ... -m cbcore`: the sharded model, the driver prints or serves, the others run its steps |
| `errors.py` | `TensorParallelError`, the group's failure (never one request's) |
"""

from __future__ import annotations

from .errors import TensorParallelError
from .group import TensorParallelGroup


def join_group(model, cpu_group_timeout: float | None) -> TensorParallelGroup | None:
    """The tensor-parallel group of `model` (None for a model on one process), with its channel and, on rank 0,
    the driver's link. A collective: every rank of the group calls it at once (the manager's constructor does)."""
    group = TensorParallelGroup.of_model(model, cpu_group_timeout)
    if group is not None:
        from .channel import StepChannel
        from .driver import DriverLink

        # One channel for the group's whole life, on every rank: its inline room carries over from one session to
        # the next (a kept manager started again) and must be the same on every rank.
        group.channel = StepChannel(group)
        if group.is_driver:
            group.driver_link = DriverLink(group)
    return group


__all__ = ["TensorParallelError", "TensorParallelGroup", "join_group"]
