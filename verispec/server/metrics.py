"""Prometheus metrics of one server, named like vLLM's (v1 engine) where a vLLM metric exists.

`ServerMetrics(model_name, prefix="vllm")` exports vLLM's names, label sets and histogram
buckets (`vllm:time_to_first_token_seconds`, ...), so vLLM's Grafana dashboards work
unchanged; `prefix="verispec"` (`--metrics-prefix verispec`) exports the same metrics as
`verispec:*`, the per-request TPOT histogram keeping its old name
`verispec:time_per_output_token_seconds`. Metrics vLLM has no counterpart for (aborted,
errored and rejected requests, engine step errors, KV blocks, the prefix hit rate) are always
`verispec:*`. docs/serving.md ("Metrics") lists every name.

Every metric lives in a per-app CollectorRegistry (never the process-global one), so two
servers in one process (tests) do not share counters. ServerMetrics is also the
AsyncEngine's RequestObserver: it is called on the event loop as the engine core reports
requests starting, progressing and ending.

Speculation counters are added once per request, from its final SpecStats, when it
finishes, fails or is aborted; so over any window the counter deltas equal the sums of
the `spec` blocks of the responses of that window (plus the aborted requests' stats).
Engine-state gauges (running/waiting, KV usage, prefix cache, preemptions) are read at
scrape time from the latest stats the engine core sent (with every step).

Request timings (time.monotonic(), one clock for every process): arrival = the server handed
the request to the engine; scheduled = the engine process admitted it (RequestEvent.
scheduled_at); first token and every later token batch = arrival of the core message
carrying them; finish = arrival of the message that ended it. Queue, prefill and decode times are observed for requests that
finished normally (stop/length), as vLLM does.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from verispec.config import spec_methods

PREFIXES = ("vllm", "verispec")
OWN = "verispec:"   # metrics vLLM has no counterpart for keep this prefix under either setting
# vLLM v1's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
REJECT_REASONS = {400: "invalid_request", 401: "unauthorized", 404: "not_found",
                  405: "method_not_allowed", 413: "body_too_large", 429: "queue_full",
                  503: "unavailable"}
# The ratio gauges: name -> (numerator, denominator), each a sample name less its prefix.
# A sum of servers (verispec/ray/metrics.py) recomputes them from the summed parts, since a
# sum of ratios means nothing; both sides read this table and divide with `ratio`.
RATIOS = {"kv_cache_usage_perc": ("kv_blocks_used", "kv_blocks_total"),
          "prefix_cache_hit_rate": ("prefix_cache_hits_total", "prefix_cache_queries_total")}


def ratio(name: str, part: Callable[[str], float]) -> float:
    """RATIOS[name] from `part` (a part's name -> its value); 0 while the denominator is 0."""
    numerator, denominator = RATIOS[name]
    d = part(denominator)
    return part(numerator) / d if d else 0.0


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_model_len:
                return tuple(out) if out else (1.0,)
            out.append(float(value))
        exponent += 1


class ServerMetrics:
    """All metrics of one server; `render()` is the /metrics body."""

    def __init__(self, model_name: str, stats_source: Callable[[], Any] | None = None,
                 prefix: str = "vllm", max_model_len: int = 2048):
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {PREFIXES}, got {prefix!r}")
        self.model_name = model_name
        self.prefix = p = prefix + ":"
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        # vLLM's names
        self.request_success = counter(p + "request_success", "Requests that finished normally.",
                                       ("finished_reason",))
        self.prompt_tokens = counter(p + "prompt_tokens", "Prompt tokens of requests the engine accepted.")
        self.generation_tokens = counter(p + "generation_tokens", "Generated tokens.")
        self.ttft = histogram(p + "time_to_first_token_seconds",
                              "Arrival to first token (every request that got one).", TTFT_BUCKETS)
        self.itl = histogram(p + "inter_token_latency_seconds",
                             "Time between two consecutive engine outputs of one request (one "
                             "observation per step that gave it tokens; with speculation a step "
                             "may give several).", ITL_BUCKETS)
        tpot = "request_time_per_output_token_seconds" if prefix == "vllm" else "time_per_output_token_seconds"
        self.tpot = histogram(p + tpot, "Per request: (finish - first token) / (output tokens - 1), "
                              "finished requests with 2 or more output tokens.", ITL_BUCKETS)
        self.e2e = histogram(p + "e2e_request_latency_seconds",
                             "Arrival to finish, finished requests.", REQUEST_LATENCY_BUCKETS)
        self.queue = histogram(p + "request_queue_time_seconds",
                               "Arrival to first scheduled by the engine.",
                               REQUEST_LATENCY_BUCKETS)
        self.inference = histogram(p + "request_inference_time_seconds",
                                   "First scheduled to finish.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram(p + "request_prefill_time_seconds",
                                 "First scheduled to first token.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram(p + "request_decode_time_seconds",
                                "First token to finish.", REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram(p + "request_prompt_tokens",
                                               "Prompt tokens per finished request.",
                                               token_buckets(max_model_len))
        self.request_generation_tokens = histogram(p + "request_generation_tokens",
                                                   "Generated tokens per finished request.",
                                                   token_buckets(max_model_len))
        spec_labels = ("method",)
        self.spec_drafts = counter(p + "spec_decode_num_drafts", "Verify rounds with k >= 1.", spec_labels)
        self.spec_draft_tokens = counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                         spec_labels)
        self.spec_accepted = counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                     spec_labels)
        self.spec_accepted_per_pos = counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position.",
                                             ("method", "position"))
        # verispec's own
        self.proposer_draft_tokens = counter(
            OWN + "spec_proposer_draft_tokens", "Draft tokens proposed, by the proposer that drafted "
            "them (method auto picks one per row and round).", ("proposer",))
        self.proposer_accepted = counter(OWN + "spec_proposer_accepted_tokens",
                                         "Draft tokens accepted, by the proposer that drafted them.", ("proposer",))
        self.request_aborted = counter(OWN + "request_aborted", "Requests aborted before finishing "
                                       "(client disconnect, cancellation, shutdown).")
        self.request_error = counter(OWN + "request_error", "Requests the engine failed.")
        self.request_rejected = counter(OWN + "request_rejected", "Requests refused before reaching "
                                        "the engine, by reason.", ("reason",))
        self.engine_step_errors = counter(OWN + "engine_step_errors",
                                          "Requests an engine step failed (each failing row counts once).")
        self._touch_defaults()
        if stats_source is not None:
            self.registry.register(_EngineStateCollector(model_name, stats_source, p))

    def _touch_defaults(self) -> None:
        """Create the common label sets at 0 so they are scraped before the first request."""
        m = self.model_name
        for reason in ("stop", "length"):
            self.request_success.labels(m, reason)
        for c in (self.request_aborted, self.request_error, self.engine_step_errors,
                  self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.tpot, self.e2e,
                  self.queue, self.inference, self.prefill, self.decode, self.request_prompt_tokens,
                  self.request_generation_tokens):
            c.labels(m)
        for method in spec_methods():
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
            prev, last = getattr(record, "prev_token_time", None), getattr(record, "last_token_time", None)
            if prev is not None and last is not None:
                self.itl.labels(self.model_name).observe(last - prev)

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
        m = self.model_name
        end = time.monotonic()
        self.e2e.labels(m).observe(end - record.arrival_time)
        n = record.last_output.completion_tokens if record.last_output else 0
        self.request_prompt_tokens.labels(m).observe(record.prompt_len)
        self.request_generation_tokens.labels(m).observe(n)
        first = record.first_token_time
        scheduled = getattr(record, "scheduled_time", None)
        if scheduled is None:  # no token at all (cannot happen for stop/length): all queue
            scheduled = first if first is not None else end
        self.queue.labels(m).observe(max(0.0, scheduled - record.arrival_time))
        self.inference.labels(m).observe(max(0.0, end - scheduled))
        if first is not None:
            self.prefill.labels(m).observe(max(0.0, first - scheduled))
            self.decode.labels(m).observe(max(0.0, end - first))
            if n > 1:
                self.tpot.labels(m).observe((end - first) / (n - 1))

    def _count_spec(self, method: str, stats) -> None:
        m = self.model_name
        self.spec_drafts.labels(m, method).inc(stats.num_drafts)
        self.spec_draft_tokens.labels(m, method).inc(stats.num_draft_tokens)
        self.spec_accepted.labels(m, method).inc(stats.num_accepted_tokens)
        for pos, n in enumerate(stats.accepted_per_position):
            self.spec_accepted_per_pos.labels(m, method, str(pos)).inc(n)
        for proposer, (drafted, accepted) in stats.by_proposer.items():
            self.proposer_draft_tokens.labels(m, proposer).inc(drafted)
            self.proposer_accepted.labels(m, proposer).inc(accepted)

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

    def __init__(self, model_name: str, stats_source: Callable[[], Any], prefix: str):
        self.model_name = model_name
        self.stats_source = stats_source
        self.prefix = prefix

    def describe(self):
        return list(self._families(None))

    def collect(self):
        return list(self._families(self.stats_source()))

    def _families(self, stats):
        def value(name: str) -> float:
            return float(getattr(stats, name, 0) or 0) if stats is not None else 0.0

        p = self.prefix
        # RATIOS' parts, by the names they are exported under
        parts = {"kv_blocks_used": value("kv_blocks_used"), "kv_blocks_total": value("kv_blocks_total"),
                 "prefix_cache_hits_total": value("prefix_hit_tokens"),
                 "prefix_cache_queries_total": value("prefix_query_tokens")}
        gauges = [
            (p + "num_requests_running", "Requests the engine is running.", value("num_running")),
            (p + "num_requests_waiting", "Requests waiting in the engine's queue.", value("num_waiting")),
            (p + "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).",
             ratio("kv_cache_usage_perc", parts.__getitem__)),
            (OWN + "kv_blocks_used", "KV blocks held by requests.", parts["kv_blocks_used"]),
            (OWN + "kv_blocks_total", "KV blocks in the pool.", parts["kv_blocks_total"]),
            (OWN + "prefix_cache_hit_rate", "Prefix-cache hit tokens / query tokens since start.",
             ratio("prefix_cache_hit_rate", parts.__getitem__)),
        ]
        for name, doc, v in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], v)
            yield g
        for name, doc, v in ((p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                              parts["prefix_cache_queries_total"]),
                             (p + "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                              parts["prefix_cache_hits_total"]),
                             (p + "num_preemptions", "Requests the engine preempted (to recompute "
                              "later) since start.", value("num_preemptions"))):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], v)
            yield c
        yield from self._proposer_families(getattr(stats, "proposer_stats", None) or {})

    def _proposer_families(self, by_method: dict):
        """Each proposer's stats() as verispec:spec_<method>_<name> (counters for "_total")."""
        for method, values in sorted(by_method.items()):
            for key, v in sorted(values.items()):
                counter = key.endswith("_total")
                name = f"{OWN}spec_{method}_{key.removesuffix('_total')}"
                family = (CounterMetricFamily if counter else GaugeMetricFamily)(
                    name, f"The {method} proposer's {key.removesuffix('_total').replace('_', ' ')}.",
                    labels=["model_name"])
                family.add_metric([self.model_name], float(v))
                yield family
