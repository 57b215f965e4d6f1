"""The server's metrics in Prometheus' text format (`GET /metrics`), named as vLLM names its own
(`vllm:num_requests_running` here is `optimum_neuron_torch:num_requests_running`), so that the
dashboards and alerts written for vLLM read them with one prefix changed.

Counted as the requests run (on the engine's thread, through each request's events): requests by
finish reason, prompt and generated tokens, and the histograms of time to first token, inter-token
latency and end-to-end latency. Read from the engine when scraped: requests running and waiting,
the share of the KV-cache slots in use, the graphs not loaded yet, the device memory, and the
compile cache's graphs compiled and loaded by this process (compile events).

Example:
    >>> metrics = ServerMetrics(engine)  # doctest: +SKIP
    >>> on_event = metrics.track(prompt_tokens=12, then=print)  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..compiler import cache_stats
from ..generation.prefix_cache import PrefixCache
from ..generation.requests import Event

PREFIX = "optimum_neuron_torch:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
# Buckets of the latency histograms, in seconds (vLLM's, from a few milliseconds to minutes).
FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The metrics of one server over `engine`, in a registry of their own (two servers in one process
    do not mix their counts).

    Args:
        engine: the server's engine (`GenerationEngine`, or what answers the same questions).
    """

    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        registry = {"registry": self.registry}
        self.requests = Counter(f"{PREFIX}request_success", "Requests finished, by finish reason (stop, length, "
                                "error, abort: the client went away).", ["finished_reason"], **registry)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens prefilled.", **registry)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated.", **registry)
        self.first_token = Histogram(f"{PREFIX}time_to_first_token_seconds", "Time from a request's arrival to its "
                                     "first token.", buckets=FIRST_TOKEN_BUCKETS, **registry)
        self.inter_token = Histogram(f"{PREFIX}inter_token_latency_seconds", "Time between two tokens of a request.",
                                     buckets=TOKEN_BUCKETS, **registry)
        self.end_to_end = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Time from a request's arrival to its "
                                    "last token.", buckets=REQUEST_BUCKETS, **registry)
        gauges = [
            ("num_requests_running", "Requests in a decode slot.", lambda: engine.busy_slots),
            ("num_requests_waiting", "Requests waiting for a slot.", lambda: engine.waiting),
            ("kv_cache_usage_perc", "Share of the KV cache's slots in use (1 is full).",
             lambda: engine.busy_slots / engine.batch_size),
            ("graphs_unloaded", "Graphs compiled, in the compile cache, not loaded yet.",
             lambda: engine.graphs_unloaded),
            ("device_memory_bytes", "Device memory allocated.", lambda: engine.device_memory()),
            ("graphs_compiled", "Graphs this process compiled (compile-cache misses).",
             lambda: cache_stats().misses),
            ("graphs_loaded", "Graphs this process loaded from the compile cache.", lambda: cache_stats().hits),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (with --enable-prefix-caching).",
             lambda: _prefixes(engine).queried),
            ("prefix_cache_hits", "Of those, the tokens whose keys and values were reused.",
             lambda: _prefixes(engine).hits),
            ("spec_decode_num_drafts", "Verify steps of speculative decoding (with --speculative-config).",
             lambda: _speculation(engine, "steps")),
            ("spec_decode_num_draft_tokens", "Tokens drafted.", lambda: _speculation(engine, "drafted")),
            ("spec_decode_num_accepted_tokens", "Of those, the tokens taken (equal to the model's greedy ones).",
             lambda: _speculation(engine, "accepted")),
        ]
        for name, documentation, read in gauges:
            Gauge(f"{PREFIX}{name}", documentation, **registry).set_function(read)

    def track(self, prompt_tokens: int, then: Callable[[Event], None]) -> Callable[[Event], None]:
        """An event callback for one engine request that counts it, then calls `then` with each event.
        Its clock starts now (the request's arrival); its `prompt_tokens` count once it has its first
        token (a request refused, or gone before, prefilled nothing)."""
        arrived = last = time.perf_counter()
        tokens = 0

        def on_event(event: Event) -> None:
            nonlocal last, tokens
            now = time.perf_counter()
            if event.completion_tokens > tokens:
                if tokens == 0:
                    self.first_token.observe(now - arrived)
                    self.prompt_tokens.inc(prompt_tokens)
                else:  # (an event carries the tokens taken since the last one: one step each)
                    for _ in range(event.completion_tokens - tokens):
                        self.inter_token.observe((now - last) / (event.completion_tokens - tokens))
                self.generation_tokens.inc(event.completion_tokens - tokens)
                tokens, last = event.completion_tokens, now
            if event.finish_reason is not None:
                self.requests.labels(event.finish_reason).inc()
                self.end_to_end.observe(now - arrived)
            then(event)

        return on_event

    def aborted(self, requests: int) -> None:
        """Counts `requests` that ended before their last token, their client gone (`abort`, as vLLM)."""
        self.requests.labels("abort").inc(requests)

    def exposition(self) -> bytes:
        """Every metric, in Prometheus' text format."""
        return generate_latest(self.registry)


def _prefixes(engine: Any) -> Any:
    """The engine's prefix cache, or an empty one (an engine without, or an embedding engine)."""
    return getattr(engine, "prefixes", None) or PrefixCache(0)


def _speculation(engine: Any, count: str) -> int:
    """A count of the engine's speculative decoding (`Speculation`), or 0 without."""
    return getattr(getattr(engine, "speculation", None), count, 0)
