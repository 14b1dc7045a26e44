"""/metrics of a replicated server: every replica's own registry (verispec/server/metrics.py),
merged with prometheus_client's parser and writer.

- `per_replica`: each replica's samples, unchanged but for one more label, `replica` (Ray's
  replica id). Summing a metric over `replica` gives the whole server, as summing vLLM's
  data-parallel engines over `engine` does. This is `/metrics`.
- `aggregate`: the sum over replicas, in exactly the single server's format (no `replica`
  label), for tools that read one server (`verispec bench`). Counters, histograms and the
  count-like gauges add up; the ratio gauges (the server's RATIOS) are recomputed from their
  summed parts by the server's own `ratio`; counters' `_created` timestamps are dropped (a
  sum of them means nothing). This is `/metrics/aggregate`.
"""
from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from verispec.server.metrics import RATIOS, ratio

REPLICA_LABEL = "replica"


class _Families:
    """A collector that yields already-built metric families (for generate_latest)."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def _render(families) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


def per_replica(texts: dict[str, str]) -> bytes:
    """Each replica's exposition (replica id -> text) as one, every sample labelled by replica."""
    merged: dict[str, object] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            labelled = [s._replace(labels={**s.labels, REPLICA_LABEL: replica}) for s in family.samples]
            into = merged.setdefault(family.name, family)
            if into is family:
                family.samples = labelled
            else:
                into.samples.extend(labelled)
    return _render(merged.values())


def aggregate(texts: dict[str, str]) -> bytes:
    """The replicas' expositions summed into one single-server exposition."""
    families: dict[str, object] = {}
    sums: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
    for text in texts.values():
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, family)
            for s in family.samples:
                if not s.name.endswith("_created"):
                    sums[s.name][tuple(sorted(s.labels.items()))] += s.value
    _recompute_ratios(sums)
    out = []
    for name, family in families.items():
        names = dict.fromkeys(s.name for s in family.samples if not s.name.endswith("_created"))
        if names:
            template = family.samples[0]
            family.samples = [template._replace(name=n, labels=dict(labels), value=v)
                              for n in names for labels, v in sums[n].items()]
            out.append(family)
    return _render(out)


def _recompute_ratios(sums: dict[str, dict[tuple, float]]) -> None:
    """Replace each summed ratio gauge in `sums` (name -> labels -> value) by its parts' ratio."""
    for name in list(sums):
        for gauge in RATIOS:
            if name.endswith(gauge):
                prefix = name[: -len(gauge)]
                for labels in sums[name]:
                    sums[name][labels] = ratio(gauge, lambda part: _find(sums, part, prefix, labels))


def _find(sums, suffix: str, prefix: str, labels: tuple) -> float:
    """The summed value of `prefix + suffix` (or the same suffix under verispec's own prefix)."""
    for name in (prefix + suffix, "verispec:" + suffix, "vllm:" + suffix):
        if labels in sums.get(name, {}):
            return sums[name][labels]
    return 0.0
