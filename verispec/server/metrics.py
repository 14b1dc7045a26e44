"""Prometheus metrics of one server, named like vLLM's where a vLLM metric exists.

Every metric lives in a per-app CollectorRegistry (never the process-global one), so two
servers in one process (tests) do not share counters. ServerMetrics is also the
AsyncEngine's RequestObserver: it is called on the event loop as the engine core reports
requests starting, progressing and ending.

Speculation counters are added once per request, from its final SpecStats, when it
finishes, fails or is aborted; so over any window the counter deltas equal the sums of
the `spec` blocks of the responses of that window (plus the aborted requests' stats).
Engine-state gauges (running/waiting, KV usage, prefix cache) are read at scrape time from
the latest stats the engine core sent (with every step).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "verispec:"
SPEC_METHODS = ("ngram", "draft", "none")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                1.0, 2.5, 5.0)
REJECT_REASONS = {400: "invalid_request", 401: "unauthorized", 404: "not_found",
                  405: "method_not_allowed", 413: "body_too_large", 429: "queue_full",
                  503: "unavailable"}


class ServerMetrics:
    """All metrics of one server; `render()` is the /metrics body."""

    def __init__(self, model_name: str, stats_source: Callable[[], Any] | None = None):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.request_success = counter("request_success", "Requests that finished normally.",
                                       ("finished_reason",))
        self.request_aborted = counter("request_aborted", "Requests aborted before finishing "
                                       "(client disconnect, cancellation, shutdown).")
        self.request_error = counter("request_error", "Requests the engine failed.")
        self.request_rejected = counter("request_rejected", "Requests refused before reaching "
                                        "the engine, by reason.", ("reason",))
        self.engine_step_errors = counter("engine_step_errors",
                                          "Requests an engine step failed (each failing row counts once).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests the engine accepted.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Arrival to last token, finished requests.", LATENCY_BUCKETS)
        spec_labels = ("method",)
        self.spec_drafts = counter("spec_decode_num_drafts", "Verify rounds with k >= 1.", spec_labels)
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                         spec_labels)
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                     spec_labels)
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position.",
                                             ("method", "position"))
        self._touch_defaults()
        if stats_source is not None:
            self.registry.register(_EngineStateCollector(model_name, stats_source))

    def _touch_defaults(self) -> None:
        """Create the common label sets at 0 so they are scraped before the first request."""
        m = self.model_name
        for reason in ("stop", "length"):
            self.request_success.labels(m, reason)
        for c in (self.request_aborted, self.request_error, self.engine_step_errors,
                  self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e):
            c.labels(m)
        for method in SPEC_METHODS:
            for c in (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted):
                c.labels(m, method)

    # ------------------------------------------------------------------ observer (event loop)
    def on_request_started(self, record) -> None:
        self.prompt_tokens.labels(self.model_name).inc(record.prompt_len)

    def on_first_token(self, record) -> None:
        self.ttft.labels(self.model_name).observe(record.first_token_time - record.arrival_time)

    def on_request_output(self, record, output) -> None:
        if output.new_token_ids:
            self.generation_tokens.labels(self.model_name).inc(len(output.new_token_ids))

    def on_request_finished(self, record, outcome: str) -> None:
        """outcome: a finish reason ("stop" | "length"), "abort" or "error"."""
        m = self.model_name
        if outcome == "abort":
            self.request_aborted.labels(m).inc()
        elif outcome == "error":
            self.request_error.labels(m).inc()
        else:
            self.request_success.labels(m, outcome).inc()
            self._observe_latency(record)
        if record.last_output is not None:
            self._count_spec(record.method, record.last_output.spec)

    def on_step_error(self, exc: BaseException, count: int = 1) -> None:
        self.engine_step_errors.labels(self.model_name).inc(count)

    def _observe_latency(self, record) -> None:
        end = time.monotonic()
        self.e2e.labels(self.model_name).observe(end - record.arrival_time)
        n = record.last_output.completion_tokens if record.last_output else 0
        if record.first_token_time is not None and n > 1:
            self.tpot.labels(self.model_name).observe((end - record.first_token_time) / (n - 1))

    def _count_spec(self, method: str, stats) -> None:
        m = self.model_name
        self.spec_drafts.labels(m, method).inc(stats.num_drafts)
        self.spec_draft_tokens.labels(m, method).inc(stats.num_draft_tokens)
        self.spec_accepted.labels(m, method).inc(stats.num_accepted_tokens)
        for pos, n in enumerate(stats.accepted_per_position):
            self.spec_accepted_per_pos.labels(m, method, str(pos)).inc(n)

    # ------------------------------------------------------------------ HTTP side
    def on_rejected(self, status: int) -> None:
        """Count a request answered with an error before it reached the engine."""
        reason = REJECT_REASONS.get(status, f"http_{status}")
        self.request_rejected.labels(self.model_name, reason).inc()

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineStateCollector:
    """Gauges and cumulative counters read from the latest EngineStats at scrape time."""

    def __init__(self, model_name: str, stats_source: Callable[[], Any]):
        self.model_name = model_name
        self.stats_source = stats_source

    def describe(self):
        return list(self._families(None))

    def collect(self):
        return list(self._families(self.stats_source()))

    def _families(self, stats):
        def value(name: str) -> float:
            return float(getattr(stats, name, 0) or 0) if stats is not None else 0.0

        total = value("kv_blocks_total")
        queries = value("prefix_query_tokens")
        hits = value("prefix_hit_tokens")
        gauges = [
            ("num_requests_running", "Requests the engine is running.", value("num_running")),
            ("num_requests_waiting", "Requests waiting in the engine's queue.", value("num_waiting")),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).",
             value("kv_blocks_used") / total if total else 0.0),
            ("kv_blocks_used", "KV blocks held by requests.", value("kv_blocks_used")),
            ("kv_blocks_total", "KV blocks in the pool.", total),
            ("prefix_cache_hit_rate", "Prefix-cache hit tokens / query tokens since start.",
             hits / queries if queries else 0.0),
        ]
        for name, doc, v in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], v)
            yield g
        for name, doc, v in (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                              queries),
                             ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], v)
            yield c
