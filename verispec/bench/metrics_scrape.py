"""Prometheus /metrics: scrape raw text, parse it keeping labels, and compute counter deltas.

Acceptance comes from counter deltas over a run. Two rules the post-mortem taught:
  * samples are matched by bare name and their labels are kept apart (a sample
    `name{model_name="m"}` IS a sample of `name`); label sets are summed explicitly;
  * zero is a measurement and missing is not: a counter absent from the scrape gives None plus a
    flag, a counter that did not move gives 0.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("verispec:", "vllm:")  # vLLM-compatible names, ours first
DRAFT_TOKENS = "spec_decode_num_draft_tokens_total"
ACCEPTED_TOKENS = "spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"
NUM_DRAFTS = "spec_decode_num_drafts_total"


@dataclass(frozen=True)
class Sample:
    """One exposition sample: full sample name, its labels, its value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def to_dict(self) -> dict:
        return {"name": self.name, "labels": dict(self.labels), "value": self.value}


@dataclass
class Scrape:
    """One GET of /metrics: the raw text (evidence) and the parsed samples."""

    url: str
    unix_time: float
    ok: bool
    http_status: int | None = None
    text: str = ""
    error: str | None = None
    samples: list[Sample] = field(default_factory=list)


def parse_metrics(text: str) -> list[Sample]:
    """Every sample in a Prometheus text exposition, labels kept, in file order."""
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.append(Sample(s.name, tuple(sorted(s.labels.items())), float(s.value)))
    return out


async def scrape(client: httpx.AsyncClient, url: str) -> Scrape:
    """GET `url` and parse it; a failure is reported in the Scrape, never raised."""
    now = time.time()
    try:
        r = await client.get(url, timeout=30)
    except httpx.HTTPError as e:
        return Scrape(url, now, ok=False, error=f"{type(e).__name__}: {e}")
    if r.status_code != 200:
        return Scrape(url, now, ok=False, http_status=r.status_code, text=r.text[:4000],
                      error=f"HTTP {r.status_code}")
    try:
        samples = parse_metrics(r.text)
    except ValueError as e:
        return Scrape(url, now, ok=False, http_status=200, text=r.text, error=f"parse error: {e}")
    return Scrape(url, now, ok=True, http_status=200, text=r.text, samples=samples)


@dataclass(frozen=True)
class CounterDelta:
    """after - before for every label set of one counter; None when it cannot be known."""

    name: str
    by_labels: dict[tuple[tuple[str, str], ...], float] | None
    flags: tuple[str, ...] = ()

    @property
    def total(self) -> float | None:
        return None if self.by_labels is None else sum(self.by_labels.values())


def counter_delta(before: list[Sample], after: list[Sample], name: str) -> CounterDelta:
    """Per-label-set increase of counter `name` between two scrapes (None + flag if missing)."""
    b = {s.labels: s.value for s in before if s.name == name}
    a = {s.labels: s.value for s in after if s.name == name}
    if not a:
        return CounterDelta(name, None, (f"missing:{name}",))
    flags = []
    out = {}
    for labels, value in a.items():
        if labels not in b:
            # Labelled counters appear on first increment; absent before means it started at 0.
            flags.append(f"series_created_during_run:{name}")
        delta = value - b.get(labels, 0.0)
        if delta < 0:
            return CounterDelta(name, None, (f"counter_reset:{name}",))
        out[labels] = delta
    if set(b) - set(a):
        flags.append(f"series_disappeared:{name}")
    return CounterDelta(name, out, tuple(sorted(set(flags))))


def _prefix(samples: list[Sample]) -> str | None:
    names = {s.name for s in samples}
    for prefix in PREFIXES:
        if any(n.startswith(prefix + "spec_decode_") for n in names):
            return prefix
    return None


def acceptance(before: Scrape | None, after: Scrape | None) -> dict:
    """Run-level acceptance from counter deltas; values are None (and flagged) when unknown."""
    result = {"prefix": None, "num_draft_tokens": None, "num_accepted_tokens": None,
              "num_drafts": None, "acceptance_rate": None, "mean_acceptance_length": None,
              "per_position": [], "label_sets": [], "flags": []}
    flags = result["flags"]
    for which, s in (("before", before), ("after", after)):
        if s is None or not s.ok:
            flags.append(f"scrape_failed:{which}")
    if flags:
        return result
    prefix = _prefix(after.samples)
    if prefix is None:
        flags.append("spec_metrics_missing")
        return result
    result["prefix"] = prefix
    deltas = {key: counter_delta(before.samples, after.samples, prefix + metric)
              for key, metric in (("num_draft_tokens", DRAFT_TOKENS),
                                  ("num_accepted_tokens", ACCEPTED_TOKENS),
                                  ("num_drafts", NUM_DRAFTS))}
    for key, d in deltas.items():
        result[key] = d.total
        flags.extend(d.flags)
    result["label_sets"] = sorted({str(dict(l)) for d in deltas.values() if d.by_labels
                                   for l in d.by_labels})
    drafted, accepted, drafts = (result["num_draft_tokens"], result["num_accepted_tokens"],
                                 result["num_drafts"])
    if drafted is not None and accepted is not None:
        if drafted > 0:
            result["acceptance_rate"] = accepted / drafted
        else:
            flags.append("no_draft_tokens_in_run")  # 0/0: undefined, not zero
    if drafts is not None and accepted is not None and drafts > 0:
        result["mean_acceptance_length"] = 1.0 + accepted / drafts
    result["per_position"] = _per_position(before, after, prefix + ACCEPTED_PER_POS, drafts, flags)
    result["flags"] = sorted(set(flags))
    return result


def _per_position(before: Scrape, after: Scrape, name: str, drafts: float | None,
                  flags: list[str]) -> list[dict]:
    d = counter_delta(before.samples, after.samples, name)
    flags.extend(d.flags)
    if d.by_labels is None:
        return []
    by_pos: dict[int, float] = {}
    for labels, value in d.by_labels.items():
        pos = dict(labels).get("position")
        if pos is None:
            flags.append(f"no_position_label:{name}")
            continue
        by_pos[int(pos)] = by_pos.get(int(pos), 0.0) + value  # summed over other labels
    if drafts is None:
        flags.append("per_position_rate_needs_num_drafts")
    return [{"position": p, "accepted": by_pos[p],
             "rate": (by_pos[p] / drafts) if drafts else None}
            for p in sorted(by_pos)]


def metrics_url_for(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port/metrics (the server root, not the API prefix)."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[:-3]
    return root + "/metrics"
