"""Rollout routes: what an RL trainer calls on a running `cbcore serve` between rollout phases (opt-in with
`--enable-rollout-routes`; behind `--api-key` like every route but /health).

The routes and their bodies are vLLM's (its development-mode and weight-transfer routes), so a trainer written for
them finds the same names: `POST /pause?mode=abort|wait|keep`, `POST /resume`, `GET /is_paused`,
`POST /reset_prefix_cache`, `POST /sleep`, `POST /wake_up`, `GET /is_sleeping`, `GET /get_world_size`,
`POST /init_weight_transfer_engine` (`{"init_info": {"master_address", "master_port", "rank_offset",
"world_size"}}`) and `POST /update_weights` (`{"update_info": {"names", "dtype_names", "shapes"}}`); plus SGLang's
`POST /update_weights_from_disk` (`{"model_path": ...}`).

The weights travel over a torch.distributed process group of the trainer and this server (gloo for a model on the CPU,
NCCL on a GPU), built from a `TCPStore` the trainer hosts at `master_address:master_port` (rank 0); the server is rank
`rank_offset`. `/update_weights` receives one broadcast from rank 0 per name, in order, then copies them into the model
at a step boundary. vLLM's own trainer side builds its group with vLLM's `StatelessProcessGroup`, which cbcore does not
speak: a trainer uses `cbcore.serving.server.rollout_routes.WeightSender` (torch only), which does both halves.

Pause modes, as vLLM's: `abort` (default: requests in flight end CANCELLED), `wait` (they finish first) and `keep`
(they stay where they are and resume on `/resume`). New requests wait while the engine is paused.
"""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .protocol import ProtocolError

PAUSE_MODES = ("abort", "wait", "keep")
RENDEZVOUS_TIMEOUT_S = 120.0
WAIT_TIMEOUT_S = 600.0  # the longest /pause?mode=wait waits for the requests in flight


class RolloutState:
    """The server's pause holder and weight-transfer group over one manager."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self._resume = threading.Event()
        self._holder: threading.Thread | None = None
        self.group: Any = None  # the weight-transfer process group, once /init_weight_transfer_engine ran
        self.lock = threading.Lock()  # one rollout operation at a time

    @property
    def paused(self) -> bool:
        """Whether /pause holds the engine."""
        return self._holder is not None

    def pause(self, mode: str) -> None:
        """Apply `mode` to the requests in flight, then park the loop until `resume()` (a thread holds the pause)."""
        if mode not in PAUSE_MODES:
            raise ProtocolError(f"'mode' must be one of {list(PAUSE_MODES)}, got {mode!r}", param="mode",
                                code="invalid_value")
        if self.paused:
            return
        if mode == "abort":
            self.manager._cancel_in_flight()
        elif mode == "wait":
            self.manager._wait_for(self.manager._requests.in_flight_ids(), WAIT_TIMEOUT_S)
        entered = threading.Event()
        failure: list[BaseException] = []
        self._resume.clear()

        def hold() -> None:
            try:
                with self.manager.pause():
                    entered.set()
                    self._resume.wait()
            except BaseException as error:  # noqa: BLE001 - reported to the caller below
                failure.append(error)
                entered.set()

        self._holder = threading.Thread(target=hold, name="cbcore-rollout-pause", daemon=True)
        self._holder.start()
        entered.wait()
        if failure:
            self._holder = None
            raise failure[0]

    def resume(self) -> None:
        """Release the pause (nothing to do when not paused)."""
        holder = self._holder
        if holder is None:
            return
        self._resume.set()
        holder.join()
        self._holder = None

    def init_group(self, init_info: Any) -> None:
        """Join the trainer's process group (blocks until every rank has joined, at most RENDEZVOUS_TIMEOUT_S)."""
        if not isinstance(init_info, dict):
            raise ProtocolError("'init_info' must be an object", param="init_info", code="invalid_type")
        try:
            address = str(init_info["master_address"])
            port, rank, world_size = (int(init_info[k]) for k in ("master_port", "rank_offset", "world_size"))
        except (KeyError, TypeError, ValueError) as error:
            raise ProtocolError(f"'init_info' needs master_address, master_port, rank_offset and world_size ({error})",
                                param="init_info", code="invalid_value") from error
        if not 0 < rank < world_size:
            raise ProtocolError("'init_info': rank_offset must be in [1, world_size) (the trainer is rank 0)",
                                param="init_info", code="invalid_value")
        timeout = timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
        if self.manager.model.device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, timeout=timeout)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def receive_weights(self, update_info: Any) -> int:
        """One broadcast from rank 0 per name, into fresh tensors; then the copy into the model (the pause mode is
        /pause's, else `keep`). Returns how many tensors came."""
        if self.group is None:
            raise ProtocolError("call /init_weight_transfer_engine first", code="no_weight_transfer_group",
                                status_code=409)
        if not isinstance(update_info, dict):
            raise ProtocolError("'update_info' must be an object", param="update_info", code="invalid_type")
        names, dtypes, shapes = (update_info.get(k) for k in ("names", "dtype_names", "shapes"))
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            raise ProtocolError("'update_info' needs lists 'names', 'dtype_names' and 'shapes' of one length",
                                param="update_info", code="invalid_value")
        known = dict(self.manager.model.named_parameters())
        known.update(self.manager.model.named_buffers())
        tensors = []
        for name, dtype_name, shape in zip(names, dtypes, shapes):
            dtype = getattr(torch, str(dtype_name), None)
            if name not in known or not isinstance(dtype, torch.dtype):
                # Every rank must still take part in each broadcast, or the trainer hangs: refuse before any.
                raise ProtocolError(f"'update_info': unknown parameter {name!r} or dtype {dtype_name!r}",
                                    param="update_info", code="invalid_value")
            tensors.append(torch.empty([int(d) for d in shape], dtype=dtype, device=known[name].device))
        options = dist.BroadcastOptions()
        options.rootRank = 0
        for tensor in tensors:
            self.group.broadcast([tensor], options).wait()
        return self.manager.update_weights(list(zip(names, tensors)), mode="keep")


class WeightSender:
    """The trainer's side of /init_weight_transfer_engine and /update_weights (torch only): hosts the rendezvous,
    joins the group as rank 0 and broadcasts named tensors to one server.

        sender = WeightSender("http://127.0.0.1:8000", port=29600, headers={"Authorization": "Bearer KEY"})
        sender.send(model.named_parameters())
    """

    def __init__(self, url: str, port: int, address: str = "127.0.0.1", headers: dict | None = None) -> None:
        import httpx

        self.url, self.headers = url.rstrip("/"), headers or {}
        timeout = timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        store = dist.TCPStore(address, port, 2, is_master=True, timeout=timeout, wait_for_workers=False)
        info = {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": 2}
        call = _background(lambda: httpx.post(self.url + "/init_weight_transfer_engine", json={"init_info": info},
                                              headers=self.headers, timeout=RENDEZVOUS_TIMEOUT_S))
        self.group = dist.ProcessGroupGloo(store, 0, 2, timeout)
        _raise_for(call.result())

    def send(self, named_tensors) -> None:
        """POST /update_weights and broadcast each tensor, in order."""
        import httpx

        items = [(name, tensor.detach().contiguous()) for name, tensor in named_tensors]
        info = {"names": [n for n, _ in items], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in items],
                "shapes": [list(t.shape) for _, t in items]}
        call = _background(lambda: httpx.post(self.url + "/update_weights", json={"update_info": info},
                                              headers=self.headers, timeout=RENDEZVOUS_TIMEOUT_S))
        options = dist.BroadcastOptions()
        options.rootRank = 0
        for _, tensor in items:
            self.group.broadcast([tensor.cpu()], options).wait()
        _raise_for(call.result())


def _background(function):
    from concurrent.futures import ThreadPoolExecutor

    executor = ThreadPoolExecutor(max_workers=1)
    future = executor.submit(function)
    executor.shutdown(wait=False)
    return future


def _raise_for(response) -> None:
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.url}: {response.status_code} {response.text}")


def add_rollout_routes(app: Any, state: Any) -> RolloutState:
    """Register the routes on the FastAPI `app` over `state.manager` (`state`: the server's `ServerState`)."""
    rollout = RolloutState(state.manager)

    async def run(function, *args):
        """`function(*args)` off the event loop, one rollout operation at a time; a refusal is a 400, a wait that
        ran out a 504."""
        def locked():
            with rollout.lock:
                return function(*args)
        try:
            return await asyncio.to_thread(locked)
        except (TypeError, ValueError) as error:
            raise ProtocolError(str(error), code="invalid_value") from error
        except TimeoutError as error:
            raise ProtocolError(str(error), code="timeout", status_code=504, error_type="server_error") from error

    @app.post("/pause")
    async def pause(mode: str = "abort"):
        await run(rollout.pause, mode)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        await run(rollout.resume)
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": rollout.paused}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        dropped = await run(state.manager.reset_prefix_cache)
        return {"status": "ok", "dropped_blocks": dropped}

    @app.get("/get_world_size")
    async def get_world_size():
        return {"world_size": 1}

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: dict):
        await run(rollout.init_group, body.get("init_info"))
        return {"message": "Weight transfer initialized"}

    @app.post("/update_weights")
    async def update_weights(body: dict):
        count = await run(rollout.receive_weights, body.get("update_info"))
        return {"message": "Weights updated", "count": count}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: dict):
        path = body.get("model_path")
        if not isinstance(path, str):
            raise ProtocolError("'model_path' must be a string", param="model_path", code="invalid_type")
        try:
            count = await run(state.manager.load_weights, path)
        except FileNotFoundError as error:
            raise ProtocolError(str(error), param="model_path", code="invalid_value") from error
        return {"success": True, "message": f"{count} tensors loaded", "count": count}

    @app.post("/sleep")
    async def sleep(level: int = 1):
        if level != 1:
            raise ProtocolError("only sleep level 1 (free the KV cache, keep the weights) is supported",
                                param="level", code="invalid_value")
        state.sleeping = True
        await run(rollout.resume)  # a paused loop cannot stop
        await run(state.manager.sleep, "abort", True)
        return {"status": "sleeping"}

    @app.post("/wake_up")
    async def wake_up():
        if state.manager.is_sleeping:
            await run(state.manager.wake_up)
        state.sleeping = False
        return {"status": "awake"}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": state.manager.is_sleeping}

    return rollout
