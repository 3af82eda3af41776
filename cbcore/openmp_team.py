"""Releasing the calling thread's OpenMP team before the generation loop's thread starts (`CBCORE_RELEASE_OPENMP_TEAM`).

torch's CPU ops (at::parallel_for, oneDNN's matmuls, inductor's generated kernels) run on OpenMP, whose thread teams
belong to the thread that opened the parallel region: every thread that runs a parallel op gets its own team of
workers, which stay alive, idle, for its next region. Between regions libgomp's workers spin-wait for a while before
they sleep, unless libgomp manages more threads than the process has CPUs: then they spin only briefly (GOMP_SPINCOUNT's
rule in libgomp's manual) and every parallel region pays for waking sleeping workers. A manager's loop thread has its
own team; the thread that built the model and called `start()` has one too as soon as it ran a single parallel op (the
start-up self-check runs several). Two teams of `torch.get_num_threads()` workers each are more threads than CPUs, so
every step's hundreds of parallel regions (two per linear layer, one per kernel) each paid a wake-up: on this machine
(2 cores, 2 torch threads) W3 ran 20-25% slower in the loop thread than in the thread that built the model, and as fast
once the caller's team was released (`bench/loop_thread_openmp.py` measures the three cases).

So `start()` releases the calling thread's team (its idle workers exit: OpenMP 5.0's `omp_pause_resource_all`) just
before it starts the loop. The caller loses nothing but idle threads: its next parallel op builds a new team. Torch
work the caller runs on the CPU while the loop serves brings a second team back, and with it the slower wake-ups:
such work competes for the same cores anyway. `CBCORE_RELEASE_OPENMP_TEAM=0` keeps the caller's team (to measure the
difference, or if another OpenMP runtime misbehaves).
"""

from __future__ import annotations

import logging

from .switches import env_switch

logger = logging.getLogger(__name__)

RELEASE_ENV = "CBCORE_RELEASE_OPENMP_TEAM"


def release_caller_openmp_team() -> bool:
    """End the calling thread's idle OpenMP workers (unless `CBCORE_RELEASE_OPENMP_TEAM=0`); whether it did. False
    with an OpenMP runtime that lacks `omp_pause_resource_all` (an OpenMP 5.0 routine) or without the C++ extension."""
    if not env_switch(RELEASE_ENV):
        return False
    try:
        from . import _C
    except ImportError:  # a checkout without the built extension: nothing to release through
        return False
    released = bool(_C.release_thread_openmp_team())
    if not released:
        logger.debug("cbcore: the OpenMP runtime did not release the calling thread's team")
    return released
