"""Build report.md (and its PNG plots) from stored run directories, never from live state."""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from verispec.bench import plots
from verispec.bench.compare import compare_runs, json_validity, ok_records
from verispec.bench.records import read_run

PLOTS_DIR = "plots"


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _p90(values):
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(0.9 * len(values)))] if values else None


def _spec_acceptance(records: list[dict]) -> float | None:
    """Sum of accepted over sum of drafted from the per-response `spec` objects, if any."""
    drafted = accepted = 0
    for r in records:
        spec = r["spec"] or {}
        d = spec.get("drafted", spec.get("num_draft_tokens"))
        a = spec.get("accepted", spec.get("num_accepted_tokens"))
        if isinstance(d, (int, float)) and isinstance(a, (int, float)):
            drafted, accepted = drafted + d, accepted + a
    return accepted / drafted if drafted else None


def spec_per_position(records: list[dict]) -> list[dict]:
    """Acceptance per draft position summed from per-response spec stats (verispec's fields)."""
    accepted: dict[int, float] = {}
    drafted: dict[int, float] = {}
    for r in ok_records(records):
        spec = r["spec"] or {}
        acc, dr = spec.get("accepted_per_position"), spec.get("drafted_per_position")
        if isinstance(acc, list) and isinstance(dr, list) and len(acc) == len(dr):
            for i, (a, d) in enumerate(zip(acc, dr)):
                accepted[i] = accepted.get(i, 0) + a
                drafted[i] = drafted.get(i, 0) + d
    return [{"position": i, "accepted": accepted[i],
             "rate": accepted[i] / drafted[i] if drafted[i] else None} for i in sorted(accepted)]


def summarize(records: list[dict]) -> dict[str, dict]:
    """Per-dataset (and "all") request counts, latency medians, throughput and acceptance."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["dataset"]].append(r)
        groups["all"].append(r)
    out = {}
    for name, rs in sorted(groups.items(), key=lambda kv: (kv[0] == "all", kv[0])):
        ok = ok_records(rs)
        e2e = sum(r["e2e_s"] for r in ok)
        jv = json_validity(rs)
        out[name] = {
            "requests": len(rs), "ok": len(ok), "errors": len(rs) - len(ok),
            "median_prompt_tokens": _median([r["prompt_tokens"] for r in ok]),
            "median_completion_tokens": _median([r["completion_tokens"] for r in ok]),
            "median_ttft_ms": _ms(_median([r["ttft_s"] for r in ok])),
            "p90_ttft_ms": _ms(_p90([r["ttft_s"] for r in ok])),
            "median_tpot_ms": _ms(_median([r["tpot_s"] for r in ok])),
            "median_decode_tps": _median([r["decode_tokens_per_s"] for r in ok]),
            "e2e_tps": sum(r["completion_tokens"] for r in ok) / e2e if e2e > 0 else None,
            "spec_acceptance": _spec_acceptance(ok),
            "json_valid": f"{jv['valid']}/{jv['checked']}" if jv["checked"] else None,
        }
    return out


def _ms(v):
    return None if v is None else 1000 * v


def _fmt(v, digits=2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return lines


_SUMMARY_COLS = [("requests", "requests"), ("ok", "ok"), ("errors", "errors"),
                 ("median_prompt_tokens", "prompt tok (med)"),
                 ("median_completion_tokens", "completion tok (med)"),
                 ("median_ttft_ms", "TTFT ms (med)"), ("p90_ttft_ms", "TTFT ms (p90)"),
                 ("median_tpot_ms", "TPOT ms (med)"), ("median_decode_tps", "decode tok/s (med)"),
                 ("e2e_tps", "e2e tok/s"), ("spec_acceptance", "acceptance (responses)"),
                 ("json_valid", "JSON valid")]


def _summary_section(manifest: dict, records: list[dict]) -> list[str]:
    summary = summarize(records)
    lines = [f"## Summary: {manifest['config_name']} (run {manifest['run_id']})", ""]
    lines += _table(["dataset"] + [c[1] for c in _SUMMARY_COLS],
                    [[name] + [s[c[0]] for c in _SUMMARY_COLS] for name, s in summary.items()])
    semantics = sorted({r["chunk_token_semantics"] for r in ok_records(records)})
    lines += ["", f"Per-chunk token counts: {', '.join(semantics) or 'n/a'} "
              "(usage_delta = exact, from cumulative usage in each chunk; unavailable = the "
              "server sent none, so decode tok/s is n/a rather than estimated).",
              "TTFT: first chunk carrying a completion token. TPOT: (e2e - TTFT) / "
              "(completion tokens - 1). Decode tok/s: tokens after the first chunk / time from "
              "the first to the last token chunk.", ""]
    return lines


def _acceptance_section(manifest: dict) -> list[str]:
    acc = (manifest["metrics"] or {}).get("acceptance")
    lines = ["## Acceptance (from /metrics counter deltas over the measured passes)", ""]
    if acc is None:
        return lines + ["Metrics scraping was disabled for this run.", ""]
    lines += _table(["metric", "value"], [
        ["prefix", acc["prefix"]], ["draft tokens", acc["num_draft_tokens"]],
        ["accepted tokens", acc["num_accepted_tokens"]], ["drafts", acc["num_drafts"]],
        ["acceptance rate", acc["acceptance_rate"]],
        ["mean acceptance length", acc["mean_acceptance_length"]]])
    if acc["per_position"]:
        lines += [""] + _table(["position", "accepted", "rate"],
                               [[p["position"], p["accepted"], p["rate"]]
                                for p in acc["per_position"]])
    if acc["flags"]:
        lines += ["", "Flags (n/a above means missing, not zero): " +
                  ", ".join(f"`{f}`" for f in acc["flags"])]
    return lines + [""]


def _completeness_section(manifest: dict) -> list[str]:
    c = manifest["counts"]
    lines = [f"Requests completed: **{c['completed']} / {c['expected']}** "
             f"({c['failed']} failed records)."]
    if manifest["status"] != "complete":
        lines = ["> **INCOMPLETE RUN**: the numbers below do not cover every expected request.",
                 ""] + lines + ["", "Missing (pass, dataset, prompt, turn):", ""]
        lines += [f"- {m['pass_index']} {m['dataset']}/{m['prompt_id']} turn {m['turn']}"
                  for m in manifest["missing"][:50]]
        if len(manifest["missing"]) > 50:
            lines.append(f"- ... and {len(manifest['missing']) - 50} more (see run.json)")
    errors = defaultdict(int)
    for e in manifest["errors"]:
        errors[e["kind"]] += 1
    if errors:
        lines += ["", "Errors by kind: " + ", ".join(f"{k}: {v}" for k, v in sorted(errors.items()))]
    return lines + [""]


def _comparison_section(cmp: dict) -> list[str]:
    lines = [f"## Comparison with baseline `{cmp['base_run']['config_name']}` "
             f"(run {cmp['base_run']['run_id']})", ""]
    if cmp["config_differences"]:
        lines += ["> **Configs differ**: " + "; ".join(
            f"{d['key']}: {d['spec']} vs {d['base']}" for d in cmp["config_differences"]), ""]
    rows = []
    for task, sp in list(cmp["speedup_by_task"].items()) + [("all", cmp["speedup"])]:
        rows.append([task] + [_ci(sp[m]) for m in ("decode_tps", "inv_tpot", "e2e_throughput")])
    lines += _table(["task", "decode tok/s speedup [95% CI]", "1/TPOT speedup [95% CI]",
                     "e2e throughput speedup [95% CI]"], rows)
    lines += ["", "Speedups: decode = geometric mean over prompts of per-request decode tok/s "
              "ratios; 1/TPOT = geometric mean of baseline TPOT / spec TPOT; e2e = ratio of "
              "summed tokens over summed end-to-end seconds. CIs: percentile bootstrap over "
              "prompts.", ""]
    eq = cmp["equality"]
    if "not_applicable" in eq:
        lines += [f"Output equality: n/a ({eq['not_applicable']}).", ""]
    else:
        lines += [f"Output equality at temperature 0: **{eq['identical']} / {eq['compared']}** "
                  "requests identical to the baseline.", ""]
        if eq["divergences"]:
            lines += _table(["dataset", "prompt", "turn", "pass", "first diff char",
                             "token >=", "spec", "baseline"],
                            [[d["dataset"], d["prompt_id"], d["turn"], d["pass_index"],
                              d["char_index"], d["token_index_at_least"],
                              _code(d["spec_excerpt"]), _code(d["base_excerpt"])]
                             for d in eq["divergences"][:30]]) + [""]
    for side in ("spec", "base"):
        varying = cmp["self_consistency"][side]["varying_across_passes"]
        if varying:
            lines.append(f"- {side}: outputs vary across passes for {len(varying)} prompt turns "
                         f"(e.g. {', '.join(varying[:5])}): divergence may not be caused by "
                         "speculation.")
    if cmp["unpaired"]["only_spec"] or cmp["unpaired"]["only_base"]:
        lines.append(f"- unpaired prompt turns: {len(cmp['unpaired']['only_spec'])} only in spec, "
                     f"{len(cmp['unpaired']['only_base'])} only in baseline")
    return lines + [""]


def _ci(s) -> str:
    if not s:
        return "n/a"
    return f"{s['point']:.3f}x [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}] (n={s['n_prompts']})"


def _code(text: str) -> str:
    return "`" + text.replace("`", "'").replace("|", "\\|").replace("\n", "\\n") + "`"


def _provenance_section(manifest: dict) -> list[str]:
    git, machine = manifest["git"], manifest["machine"]
    lines = ["## Provenance", "",
             f"- verispec commit `{git.get('commit')}` (dirty: {git.get('dirty')})",
             f"- model `{manifest['model']}`; server models: {manifest['server_models']}",
             f"- machine: {machine.get('cpu_model')}, {machine.get('logical_cores')} logical "
             f"cores, {_fmt((machine.get('ram_bytes') or 0) / 2**30, 1)} GiB RAM",
             f"- versions: " + ", ".join(f"{k} {v}" for k, v in manifest["versions"].items() if v),
             "- datasets:"]
    for d in manifest["datasets"]:
        pin = ""
        if d.get("pinned_version") and d.get("package_version") != d.get("pinned_version"):
            pin = f" **(pinned {d['pinned_version']})**"
        lines.append(f"  - {d['name']}: {d.get('package') or 'file'} "
                     f"{d.get('package_version') or ''}{pin}, sha256 {d['sha256'][:12]}")
    lines += ["", "Configuration:", "", "```json", json.dumps(manifest["config"], indent=1), "```", ""]
    return lines


def _plots(run_dir: Path, manifest: dict, records: list[dict], base, cmp) -> list[str]:
    out = run_dir / PLOTS_DIR
    out.mkdir(exist_ok=True)
    made = []
    label = manifest["config_name"]
    series = {"ttft": {label: [r["ttft_s"] * 1000 for r in ok_records(records)]},
              "tpot": {label: [r["tpot_s"] * 1000 for r in ok_records(records)
                               if r["tpot_s"] is not None]}}
    if base is not None:
        bm, brs = base
        series["ttft"][f"{bm['config_name']} (baseline)"] = [r["ttft_s"] * 1000 for r in ok_records(brs)]
        series["tpot"][f"{bm['config_name']} (baseline)"] = [
            r["tpot_s"] * 1000 for r in ok_records(brs) if r["tpot_s"] is not None]
    acc = (manifest["metrics"] or {}).get("acceptance") or {}
    made.append(plots.distribution(series["ttft"], "TTFT (ms)", "Time to first token",
                                   out / "ttft_distribution.png"))
    made.append(plots.distribution(series["tpot"], "TPOT (ms)", "Time per output token",
                                   out / "tpot_distribution.png"))
    # /metrics deltas first; the responses' own spec stats when the server exposes no counters
    per_position = acc.get("per_position") or spec_per_position(records)
    made.append(plots.acceptance_per_position(per_position, out / "acceptance_per_position.png"))
    if cmp is not None:
        made.append(plots.speedup_by_task(cmp["speedup_by_task"], "decode_tps",
                                          out / "speedup_by_task.png"))
    return [f"![{p.stem}]({PLOTS_DIR}/{p.name})" for p in made if p is not None]


def build_report(run_dir: Path, baseline_dir: Path | None = None, resamples: int = 2000,
                 seed: int = 0) -> Path:
    """Write run_dir/report.md (+ plots/, + comparison.json with a baseline); return its path."""
    run_dir = Path(run_dir)
    manifest, records = read_run(run_dir)
    cmp = base = None
    if baseline_dir is not None:
        base = read_run(Path(baseline_dir))
        cmp = compare_runs(run_dir, Path(baseline_dir), resamples, seed)
        (run_dir / "comparison.json").write_text(json.dumps(cmp, indent=1))
    lines = [f"# verispec bench report: {manifest['config_name']}", ""]
    lines += _completeness_section(manifest)
    lines += _summary_section(manifest, records)
    lines += _acceptance_section(manifest)
    if cmp is not None:
        lines += _comparison_section(cmp)
    images = _plots(run_dir, manifest, records, base, cmp)
    if images:
        lines += ["## Plots", ""] + [f"{img}\n" for img in images]
    lines += _provenance_section(manifest)
    path = run_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def build_sweep_report(sweep_dir: Path, run_dirs: list[Path]) -> Path:
    """report.md over runs at several temperatures: acceptance vs temperature, one row per run."""
    sweep_dir = Path(sweep_dir)
    rows, points = [], []
    for d in run_dirs:
        manifest, records = read_run(d)
        acc = ((manifest["metrics"] or {}).get("acceptance") or {}).get("acceptance_rate")
        if acc is None:
            acc = _spec_acceptance(ok_records(records))
        t = manifest["config"]["temperature"]
        points.append((t, acc))
        s = summarize(records)["all"]
        rows.append([Path(d).name, t, manifest["status"], acc, s["median_decode_tps"],
                     s["e2e_tps"], f"[report]({Path(d).name}/report.md)"])
    (sweep_dir / PLOTS_DIR).mkdir(parents=True, exist_ok=True)
    plot = plots.acceptance_vs_temperature(points, sweep_dir / PLOTS_DIR / "acceptance_vs_temperature.png")
    lines = ["# verispec bench sweep over temperature", ""]
    lines += _table(["run", "temperature", "status", "acceptance", "decode tok/s (med)",
                     "e2e tok/s", "details"], rows)
    if plot is not None:
        lines += ["", f"![acceptance_vs_temperature]({PLOTS_DIR}/{plot.name})"]
    path = sweep_dir / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
