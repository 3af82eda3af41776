"""`TensorParallelGroup`: the tensor-parallel group a model was loaded over, as cbcore sees it.

transformers' tensor-parallel plan (`from_pretrained(tp_plan="auto")` or `distributed_config=DistributedConfig(
tp_size=N)` under `torchrun`) shards the model's linear layers over a device mesh and does the forward's collectives
itself. cbcore adds one engine per rank: rank 0 of the group is the driver (it takes requests, schedules, samples and
delivers), and it sends every step to the others over a CPU (gloo) process group of its own, created with
`cpu_group_timeout` so that no rank waits for another longer than that (transformers does the same for its own
continuous batching, `DistributedHelper`).

Each rank sizes its KV cache from its own memory; the group agrees on the smallest (`agree_min`), since the driver's
block ids must be valid on every rank. A rank's KV heads are its shard: the attention layers receive the rank's
heads, and `CacheShape.from_model` reads them off the probe forward.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import TensorParallelError

logger = logging.getLogger("cbcore")

# torch's own default for gloo groups, used when cpu_group_timeout is None (transformers passes None to torch then).
DEFAULT_GROUP_TIMEOUT_S = 1800.0


def tensor_parallel_mesh(model: torch.nn.Module):
    """The model's tensor-parallel device mesh when transformers sharded it over more than one rank, else None.

    Raises NotImplementedError for pipeline or FSDP sharding (the mesh's other dims), which cbcore does not serve."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return None
    names = mesh.mesh_dim_names
    if names is None:  # a mesh without names is a plain tensor-parallel mesh (transformers' rule)
        return mesh if mesh.size() > 1 else None
    for other in ("pp", "fsdp"):
        if other in names and mesh[other].size() > 1:
            raise NotImplementedError(
                f"{type(model).__name__} is sharded with {other}_size={mesh[other].size()}; cbcore serves tensor "
                "parallelism only (DistributedConfig(tp_size=N)); load the model without pipeline or FSDP sharding"
            )
    if "tp" in names and mesh["tp"].size() > 1:
        return mesh["tp"]
    return None


class TensorParallelGroup:
    """This process's place in the model's tensor-parallel group, and the CPU group cbcore talks over.

    Built by the manager's constructor on every rank at once (creating the CPU group is a collective). `rank` and
    `size` are within the tensor-parallel group; the driver is its rank 0. `broken` is set when a collective failed
    or a rank reported a fatal error: the group cannot be used again (start() refuses), and nothing is sent on it."""

    def __init__(self, ranks: list[int], rank: int, cpu_group_timeout: float | None, model_backend: str = "gloo",
                 model_group: dist.ProcessGroup | None = None, model_device: str = "cpu") -> None:
        """`ranks`: the group's global ranks, by tensor-parallel rank; `rank`: this process's tensor-parallel rank;
        `model_group`: the process group the model's forward does its collectives on, from tensors on
        `model_device` (a device type). Use `of_model` for a model transformers sharded (this constructor is for
        that and for benchmarks)."""
        self.size = len(ranks)
        self.rank = rank
        self.is_driver = rank == 0
        self.model_backend = model_backend
        self.global_ranks = ranks
        self.root = ranks[0]
        self.timeout_s = float(cpu_group_timeout) if cpu_group_timeout is not None else DEFAULT_GROUP_TIMEOUT_S
        # A group of its own on the CPU (gloo), whatever the model's backend: the plan is ints that live on the host,
        # and a CPU group never queues behind the device's work. When the tensor-parallel group is part of a larger
        # world (data-parallel replicas), only its members take part in creating it.
        self.cpu_group = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=timedelta(seconds=self.timeout_s),
            use_local_synchronization=len(ranks) < dist.get_world_size(),
        )
        self.broken: str | None = None
        self.model_group = model_group
        self.model_device = model_device
        # How many collectives this rank's last forward issued on the model's group (`counting_collectives`); every
        # exchange carries it, so the ranks notice a forward that stopped short of a collective on one of them.
        self.last_forward_collectives = 0
        # Set by `join_group`: the group's `StepChannel` (every rank), the driver's end of it (rank 0; else None).
        self.channel = None
        self.driver_link = None
        if self.model_backend == "nccl" and os.environ.get("NCCL_GRAPH_MIXING_SUPPORT") != "0":
            # As transformers warns (disable_nccl_graph_mixing): the variable must be set before the process group is
            # created. cbcore captures no CUDA graphs yet, so only NCCL's own cost is at stake.
            logger.warning(
                "cbcore: NCCL_GRAPH_MIXING_SUPPORT was not set to 0 before init_process_group; build the "
                "ContinuousBatchingConfig before loading the model, or set NCCL_GRAPH_MIXING_SUPPORT=0 at launch"
            )

    @classmethod
    def of_model(cls, model: torch.nn.Module, cpu_group_timeout: float | None) -> TensorParallelGroup | None:
        """The group of a model transformers sharded over several ranks; None for a model on one process. Raises
        ValueError for KV heads the plan cannot split (`check_kv_heads`)."""
        mesh = tensor_parallel_mesh(model)
        if mesh is None:
            return None
        check_kv_heads(model, mesh.size())
        model_group = mesh.get_group()
        return cls(dist.get_process_group_ranks(model_group), mesh.get_local_rank(), cpu_group_timeout,
                   dist.get_backend(model_group), model_group, next(model.parameters()).device.type)

    def collectives_issued(self) -> int:
        """How many collectives this rank has issued on the model's process group (its sequence number; 0 without
        one)."""
        if self.model_group is None:
            return 0
        return int(self.model_group._get_sequence_number_for_group())

    @contextmanager
    def counting_collectives(self) -> Iterator[None]:
        """Around one forward: record in `last_forward_collectives` how many collectives it issued, also when it
        raised. Every rank's forward of the same plan issues the same collectives, unless one raised before a
        collective the others entered: then the counts differ, the model's group is out of step (its next
        collectives would pair with the wrong ones), and the next exchange ends the group on every rank
        (`Received.group_failure`). Collectives outside the forwards (a user's weight broadcast inside a pause) are
        not counted, so they cannot be mistaken for a failure."""
        before = self.collectives_issued()
        try:
            yield
        finally:
            self.last_forward_collectives = self.collectives_issued() - before

    @contextmanager
    def bounded_model_collectives(self) -> Iterator[None]:
        """While this rank's loop runs: a collective of the model's forward waits at most half of
        cpu_group_timeout (never longer than the model group's own timeout). A rank whose forward raised before a
        collective goes on to the next exchange and waits there up to cpu_group_timeout; a rank blocked in that
        collective gets its error first, comes to the same exchange, and both read that the group is out of step,
        instead of one waiting out the model group's timeout (transformers initializes it with 2 hours). The model
        group's own timeout is restored when the loop ends."""
        own = self._model_group_timeout()
        bounded = timedelta(seconds=self.timeout_s / 2)
        if own is None or own <= bounded:
            yield
            return
        dist.set_timeout(bounded, self.model_group)
        try:
            yield
        finally:
            try:
                dist.set_timeout(own, self.model_group)
            except (RuntimeError, ValueError) as error:  # the group was torn down meanwhile
                logger.debug(f"cbcore: restoring the model group's timeout: {error}")

    def _model_group_timeout(self) -> timedelta | None:
        """The model group's current timeout, where its backend says it (gloo and NCCL do); None otherwise."""
        if self.model_group is None:
            return None
        try:
            return self.model_group._get_backend(torch.device(self.model_device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            return None

    def agree_min(self, values: list[int], what: str) -> list[int]:
        """The smallest of each value over the ranks (block counts: the driver's block ids must exist everywhere)."""
        tensor = torch.tensor(values, dtype=torch.int64)
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        except RuntimeError as error:
            raise self.failed(f"agreeing on {what}", error) from error
        return tensor.tolist()

    def failed(self, what: str, error: BaseException) -> TensorParallelError:
        """Mark the group broken after a collective raised, and say what happened in terms a user can act on."""
        self.broken = f"{what} failed: {error}"
        return TensorParallelError(
            f"tensor-parallel rank {self.rank}: {what}: the group did not answer within cpu_group_timeout="
            f"{self.timeout_s:g}s, or a rank left it ({type(error).__name__}: {error}). Every rank must run the same "
            "manager calls (start, pause, stop); a rank that stops answering ends the group"
        )

    def destroy(self) -> None:
        """Release the CPU group (idempotent)."""
        if self.cpu_group is not None:
            try:
                dist.destroy_process_group(self.cpu_group)
            except (RuntimeError, ValueError) as error:  # already torn down with the default group
                logger.debug(f"cbcore: destroying the CPU group: {error}")
            self.cpu_group = None
            self.broken = self.broken or "the manager was destroyed"


def check_kv_heads(model: torch.nn.Module, tp_size: int) -> None:
    """Refuse a model whose KV heads the tensor-parallel plan cannot split evenly (GQA with fewer KV heads than
    ranks): transformers' plan shards the K/V projections by columns, so each rank would get part of a head. Mirrors
    transformers' own continuous batching, which refuses it too."""
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    if heads is None:
        return
    if get_kv_heads_per_rank(getattr(model, "tp_plan", {}) or {}, heads, tp_size) is None:
        raise ValueError(
            f"{type(model).__name__} has {heads} KV heads, which its tensor-parallel plan cannot split over "
            f"{tp_size} ranks (the K/V projections are sharded by heads); use a tensor-parallel size that divides "
            f"{heads}, or a plan that replicates the K/V projections"
        )
