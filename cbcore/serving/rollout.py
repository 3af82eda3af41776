"""What an RL trainer does to a running manager between rollout phases: new weights in place, the prefix cache reset,
the cache freed while the trainer needs the memory (sleep) and rebuilt after (wake up).

`update_weights` follows the pause modes of vLLM's and TRL's weight-sync routes: `keep` (requests in flight go on,
their next tokens from the new weights; the K/V they hold was computed with the old ones, as with vLLM's `keep`),
`abort` (every request in flight ends CANCELLED first, so no token after the update comes from a mixed cache) and
`wait` (the requests in flight at the call finish first; requests added meanwhile run and are then in flight like
`keep`'s). The copy happens while the loop is parked between two steps (`pause()`); when the loop resumes it sees
the parameters' version counters move, so the prefix cache is invalidated (no new request shares K/V of the old
weights) and cbcore's packed copies of the linear layers are repacked (cbcore/engine/core.py,
`notice_weight_changes`).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from .. import request_inputs

PAUSE_MODES = ("keep", "abort", "wait")


class RolloutControl:
    """The manager's `update_weights`, `load_weights`, `reset_prefix_cache`, `sleep` and `wake_up` (mixed into
    `ContinuousBatchingManager`)."""

    def update_weights(self: Any, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       mode: str = "keep", timeout: float | None = None) -> int:
        """Copy named tensors (names as `model.named_parameters()` / `named_buffers()` give them; any subset) into the
        model, at a step boundary of the running loop; returns how many were copied. Everything is checked before
        anything is copied: an unknown name, a tensor of another shape or a non-tensor raises ValueError / TypeError
        naming it and changes nothing. `mode`: "keep", "abort" or "wait" (the module's docstring); `timeout`: how
        long "wait" waits for the requests in flight (TimeoutError past it, nothing copied)."""
        if not isinstance(mode, str) or mode not in PAUSE_MODES:
            raise ValueError(f"update_weights: mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        timeout = request_inputs.timeout_seconds(timeout, "update_weights: timeout")
        if self._tensor_parallel is not None:
            raise NotImplementedError("update_weights: under tensor parallelism each rank holds a shard; update "
                                      "every rank's model inside `with manager.pause():` instead")
        if isinstance(weights, Mapping):
            items = list(weights.items())
        elif isinstance(weights, (str, bytes, torch.Tensor)) or not isinstance(weights, Iterable):
            raise TypeError(f"update_weights: weights must be a mapping of names to tensors or (name, tensor) pairs, "
                            f"got {type(weights).__name__}")
        else:
            items = list(weights)
        targets = dict(self.model.named_parameters())
        targets.update(self.model.named_buffers())
        for index, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(f"update_weights: weights[{index}] must be a (name, tensor) pair")
            name, tensor = item
            if name not in targets:
                raise ValueError(f"update_weights: the model has no parameter or buffer named {name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"update_weights: {name} must be a tensor, got {type(tensor).__name__}")
            if tensor.shape != targets[name].shape:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, the model's "
                                 f"{tuple(targets[name].shape)}")
        if mode == "abort":
            self._cancel_in_flight()
        elif mode == "wait":
            self._wait_for(self._requests.in_flight_ids(), timeout)
        with self.pause(), torch.no_grad():
            for name, tensor in items:
                targets[name].copy_(tensor)
        return len(items)

    def load_weights(self, path: str | Path, mode: str = "keep", timeout: float | None = None) -> int:
        """`update_weights` from a safetensors file, or from every `*.safetensors` file of a folder (a checkpoint
        saved with `save_pretrained`); returns how many tensors were copied."""
        from safetensors.torch import load_file

        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"load_weights: path must be a str or a path, got {type(path).__name__}")
        if not isinstance(mode, str) or mode not in PAUSE_MODES:
            raise ValueError(f"load_weights: mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        request_inputs.timeout_seconds(timeout, "load_weights: timeout")
        path = Path(path)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not all(file.is_file() for file in files):
            raise FileNotFoundError(f"load_weights: no safetensors file at {path}")
        weights: dict[str, torch.Tensor] = {}
        for file in files:
            weights.update(load_file(str(file)))
        return self.update_weights(weights, mode=mode, timeout=timeout)

    def reset_prefix_cache(self: Any) -> int:
        """Stop sharing every cached prefix block (requests still holding blocks keep them); returns how many blocks
        were dropped from the prefix cache. A trainer calls it after changing the weights by other means."""
        with self.pause():
            return self.engine.cache.invalidate_prefixes() if self.engine is not None else 0

    def sleep(self: Any, mode: str = "abort", offload_weights: bool = False, timeout: float | None = None) -> None:
        """Free the KV cache (and the state pool) between rollout phases: the requests in flight are cancelled
        ("abort") or finished first ("wait"; "keep" cannot be: their K/V is what is freed), the loop stops and the
        engine is dropped; `add_request` raises until `wake_up()`. `offload_weights`: also move the model's weights
        to host memory (a model on a GPU; on a CPU they are there already). vLLM's sleep level 1."""
        if not isinstance(mode, str) or mode not in ("abort", "wait"):
            raise ValueError(f"sleep: mode must be 'abort' or 'wait' (a sleeping engine keeps no request), "
                             f"got {mode!r}")
        timeout = request_inputs.timeout_seconds(timeout, "sleep: timeout")
        offload_weights = request_inputs.flag(offload_weights, "sleep: offload_weights")
        if self._tensor_parallel is not None:
            raise NotImplementedError("sleep: not under tensor parallelism (every rank would have to sleep at once)")
        if not self.is_running():
            raise RuntimeError("sleep: the manager is not running")
        if mode == "abort":
            self._cancel_in_flight()
        self.stop(block=True, timeout=timeout)
        if self.is_running():
            raise TimeoutError(f"sleep: the loop did not finish its requests within {timeout} s")
        with self._requests.lock:
            self._requests.closed_reason = "the manager is asleep (sleep()); call wake_up() to serve again"
        self._release()
        self._awake_device = None
        if offload_weights and self.model.device.type != "cpu":
            self._awake_device = self.model.device
            self.model.to("cpu")
        gc.collect()
        self._asleep = True

    def wake_up(self: Any) -> None:
        """Serve again after `sleep()`: the weights back on their device, a fresh engine and cache, the loop started."""
        if not getattr(self, "_asleep", False):
            raise RuntimeError("wake_up: the manager is not asleep")
        if self._awake_device is not None:
            self.model.to(self._awake_device)
        self._asleep = False
        self.start()

    @property
    def is_sleeping(self) -> bool:
        """Whether `sleep()` freed the engine and `wake_up()` has not been called since."""
        return getattr(self, "_asleep", False)

    def _cancel_in_flight(self: Any) -> None:
        """Cancel every request in flight now (each ends with one CANCELLED output)."""
        for request_id in self._requests.in_flight_ids():
            self.cancel_request(request_id)

    def _wait_for(self: Any, request_ids: set[str], timeout: float | None) -> None:
        """Until none of `request_ids` is in flight (each got its terminal output)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while request_ids & self._requests.in_flight_ids():
            if not self.is_running():
                raise RuntimeError("update_weights: the loop stopped while waiting for the requests in flight")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"update_weights: requests still in flight after {timeout} s; nothing copied")
            time.sleep(0.01)
