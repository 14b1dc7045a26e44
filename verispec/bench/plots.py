"""PNG plots for the report (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def speedup_by_task(by_task: dict, metric: str, path: Path) -> Path | None:
    """Bar per task: point speedup with its 95% bootstrap interval; 1.0 marked."""
    rows = [(task, v[metric]) for task, v in sorted(by_task.items()) if v.get(metric)]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(4, 1.1 * len(rows) + 2), 3.6))
    points = [r["point"] for _, r in rows]
    err = [[p - r["ci95"][0] for p, (_, r) in zip(points, rows)],
           [r["ci95"][1] - p for p, (_, r) in zip(points, rows)]]
    ax.bar([t for t, _ in rows], points, yerr=err, capsize=4, color="#4c72b0")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_ylabel(f"speedup ({metric})")
    ax.set_title("Speedup over baseline by task (95% bootstrap CI)")
    ax.tick_params(axis="x", rotation=30)
    return _save(fig, path)


def acceptance_per_position(per_position: list[dict], path: Path) -> Path | None:
    """Acceptance rate at each draft position (from /metrics counter deltas)."""
    rows = [p for p in per_position if p.get("rate") is not None]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.bar([str(p["position"]) for p in rows], [p["rate"] for p in rows], color="#55a868")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_title("Acceptance per draft position")
    return _save(fig, path)


def distribution(series: dict[str, list[float]], xlabel: str, title: str, path: Path) -> Path | None:
    """Empirical CDF of one latency per configuration (e.g. spec vs baseline TTFT)."""
    series = {k: sorted(v) for k, v in series.items() if v}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, values in series.items():
        n = len(values)
        ax.step(values, [(i + 1) / n for i in range(n)], where="post", label=f"{name} (n={n})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def acceptance_vs_temperature(points: list[tuple[float, float]], path: Path) -> Path | None:
    """Acceptance rate of each run against its sampling temperature (needs >= 2 temperatures)."""
    points = sorted(p for p in points if p[1] is not None)
    if len({t for t, _ in points}) < 2:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.plot([t for t, _ in points], [a for _, a in points], marker="o")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("temperature")
    ax.set_ylabel("acceptance rate")
    ax.set_title("Acceptance vs temperature")
    ax.grid(alpha=0.3)
    return _save(fig, path)
