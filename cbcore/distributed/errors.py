"""The one error of the tensor-parallel group: a rank failed, left, or did not answer in time."""

from __future__ import annotations


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group failed, left it, or did not answer within `cpu_group_timeout` (a rank that
    did not enter `pause()`, a process that died). It is the group's failure, not one request's: the engine never
    isolates it as a culprit (`EngineCore._execute_isolating_failures` lets it through), the loop that meets it ends
    and fails what it holds, and every other rank is told or times out."""
