"""Serving requests with continuous batching (docs/design.md, "The layers", "Threads", "The server"): the manager, and
what sits in front of it.

| module | one job |
|---|---|
| `manager.py` | `ContinuousBatchingManager`: construction, the engine it builds, start / stop / join / destroy, results, counters |
| `submission.py` | `add_request`, `add_requests`, `cancel_request` on the caller's thread: arguments checked, the input queue |
| `request_registry.py` | `RequestRegistry`: the ids in flight, automatic ids, the requests queued but not taken in, whether requests are accepted |
| `generation_config.py` | the generation config as `model.generate` prepares it, its logits processors, the modes refused |
| `generation_loop.py` | the loop thread that steps the engine (intake, cancellations, delivery) and `pause()` |
| `server/` | the OpenAI-compatible HTTP server behind `python -m cbcore serve` |

`cbcore.manager` keeps the import path `from cbcore.manager import ContinuousBatchingManager` working.
"""
