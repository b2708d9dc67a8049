"""Prometheus metrics for the server (``GET /metrics``), in a registry of their own (one per app, so tests and
several apps in one process do not share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mlxinfer_requests", "Finished HTTP requests by route and status (every route but "
                                "/health; 'other': unknown paths).",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("mlxinfer_prompt_tokens", "Prompt tokens of accepted requests (as in usage).",
                                     registry=r)
        self.prefill_tokens = Counter("mlxinfer_prefill_tokens", "Prompt tokens actually run through the model "
                                      "(the rest came from the prefix cache).", registry=r)
        self.generation_tokens = Counter("mlxinfer_generation_tokens", "Tokens generated (as in usage).",
                                         registry=r)
        self.ttft = Histogram("mlxinfer_time_to_first_token_seconds", "Request arrival to its first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("mlxinfer_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("mlxinfer_queue_depth", "Requests waiting for a sequence slot.", registry=r)
        self.running = Gauge("mlxinfer_running_sequences", "Sequences being prefilled or decoded.", registry=r)
        self.batch_size = Gauge("mlxinfer_decode_batch_size", "Sequences in the last decode step.", registry=r)
        self.batch_peak = Gauge("mlxinfer_decode_batch_size_max", "The largest decode batch since the start.",
                                registry=r)
        self.kv_bytes = Gauge("mlxinfer_kv_cache_bytes", "Bytes held by the running sequences' KV caches.",
                              registry=r)
        self.prefix_bytes = Gauge("mlxinfer_prefix_cache_bytes", "Bytes held by the prefix cache.", registry=r)
        self.prefix_lookups = Counter("mlxinfer_prefix_cache_lookups", "Prefix-cache lookups (one per request).",
                                      registry=r)
        self.engine_errors = Counter("mlxinfer_engine_errors", "Errors the engine recovered from without failing a "
                                     "request, by stage (shared_start: the shared-start prefill, skipped).",
                                     ["stage"], registry=r)
        self.prefix_hits = Counter("mlxinfer_prefix_cache_hits", "Lookups that reused a stored prefix.", registry=r)
        self.prefix_tokens = Counter("mlxinfer_prefix_cache_reused_tokens", "Prompt tokens taken from the prefix "
                                     "cache instead of being prefilled.", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
