"""The OpenAI-compatible HTTP server behind `python -m cbcore serve` (docs/design.md, "The server"): FastAPI + uvicorn
over one `ContinuousBatchingManager`.

| module | one job |
|---|---|
| `protocol.py` | OpenAI request bodies: parsing and validation (`ProtocolError`: OpenAI's error body) |
| `fields.py` | the fields OpenAI's, vLLM's and SGLang's servers accept: which cbcore honours, accepts or refuses |
| `detokenizer.py` | incremental detokenization that never splits a multi-byte character; stop strings on the text |
| `generation.py` | one request's lifecycle on the manager: add its choices, stream snapshots, stop, cancel, usage |
| `metrics.py` | the Prometheus metrics (`/metrics`) |
| `app.py` | the FastAPI routes, auth, backpressure, engine-death watchdog, response and SSE chunk bodies |
| `launch.py` | building the manager from the command line and running uvicorn (`serve` in `cbcore/cli/serve.py`) |

Importing this package needs the `serve` extra (fastapi, uvicorn, prometheus_client).
"""
