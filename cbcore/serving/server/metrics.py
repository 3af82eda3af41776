"""The server's Prometheus metrics (`GET /metrics`, text format), in a registry of its own per app.

Counted by the server as requests go: HTTP requests by endpoint and outcome, prompt and generated tokens, time to
first token and inter-token latency, and the choices waiting (added to the manager, no token yet) and running.
Read from `manager.stats()` at each scrape (one owner per fact: the engine counts its blocks): cache blocks used /
free / cached / total, prefix-cache hit rate and hit tokens, preemptions, engine steps.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

# Outcomes of one HTTP request: served; refused as invalid (400/404); refused for load (429); refused by auth (401);
# the client went away (cancelled); the engine failed it or is down (5xx).
OUTCOMES = ("success", "invalid", "rejected", "unauthorized", "cancelled", "failed")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# manager.stats() keys exported as gauges: name -> help.
_ENGINE_STATS = {
    "blocks_used": "KV-cache blocks referenced by requests",
    "blocks_free": "KV-cache blocks free",
    "blocks_cached": "KV-cache blocks holding cached prefixes, unused",
    "num_blocks": "KV-cache blocks in total",
    "prefix_hit_rate": "prefix-cache lookups that hit, as a fraction",
    "prefix_hit_tokens": "prompt tokens taken from the prefix cache",
    "preemptions": "running requests preempted to make room",
    "steps": "engine steps (forwards) run",
    "generated_tokens": "tokens the engine generated (cancelled requests' included)",
}


class _EngineCollector:
    """Reads `manager.stats()` when scraped."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def describe(self):
        """prometheus_client's collector protocol: no fixed descriptions (they are collected live)."""
        return []

    def collect(self):
        """The gauges read from `manager.stats()` at scrape time."""
        stats = self.manager.stats()
        for key, help_text in _ENGINE_STATS.items():
            if key in stats:
                family = GaugeMetricFamily(f"cbcore_cache_{key}" if key.startswith(("blocks", "num_blocks", "prefix"))
                                           else f"cbcore_engine_{key}", help_text)
                family.add_metric([], float(stats[key]))
                yield family
        family = GaugeMetricFamily("cbcore_engine_input_queue_length", "requests in the manager's input queue")
        family.add_metric([], float(self.manager.input_queue.qsize()))
        yield family


class ServerMetrics:
    """The metrics of one app."""

    def __init__(self, manager: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cbcore_http_requests", "HTTP requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("cbcore_prompt_tokens", "prompt tokens of the requests added", registry=r)
        self.generated_tokens = Counter("cbcore_generated_tokens", "tokens generated", registry=r)
        self.waiting = Gauge("cbcore_requests_waiting", "choices added to the engine without a token yet", registry=r)
        self.running = Gauge("cbcore_requests_running", "choices generating", registry=r)
        self.ttft = Histogram("cbcore_time_to_first_token_seconds", "from add_request to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("cbcore_inter_token_latency_seconds", "between two tokens of one choice",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(manager))
        self.num_waiting = 0

    # The server's queue: choices added and without a token yet (what --max-queue-size bounds), and choices generating.
    def choice_added(self) -> None:
        """A choice was added to the manager: it waits for its first token."""
        self.num_waiting += 1
        self.waiting.inc()

    def choice_started(self) -> None:
        """A choice got its first token: it is generating."""
        self.num_waiting -= 1
        self.waiting.dec()
        self.running.inc()

    def choice_ended(self, started: bool) -> None:
        """A choice ended (`started`: it had got a token)."""
        if started:
            self.running.dec()
        else:
            self.num_waiting -= 1
            self.waiting.dec()

    def count(self, endpoint: str, outcome: str) -> None:
        """Count one HTTP request by endpoint and outcome."""
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
