"""`verispec bench`: flags, and the exit code that says whether the evidence is complete.

Exit codes: 0 complete run (and, with --require-identical, no temperature-0 divergence);
1 incomplete run, schema violation or divergence; 2 invalid input (flags, dataset, out dir).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from verispec.bench.datasets import BUILTIN_DATASETS, SUITES, DatasetError
from verispec.bench.protocol.config import BenchConfig
from verispec.bench.protocol.runner import RUN_FILE, ProtocolError, run_benchmark
from verispec.bench.records import SchemaError
from verispec.bench.report import build_report, build_sweep_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the bench flags on `parser` (verispec's CLI wires `verispec bench` to this)."""
    names = ", ".join(sorted(BUILTIN_DATASETS) + sorted(SUITES))
    parser.add_argument("--base-url", help="OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--launch", metavar="ENGINE_ARGS",
                        help="instead of --base-url: start `verispec serve ENGINE_ARGS` on a free "
                             "loopback port for this run, e.g. --launch \"--spec ngram --dtype float32\"")
    parser.add_argument("--launch-llama-server", metavar="LLAMA_ARGS",
                        help="instead of --base-url: start llama.cpp's llama-server with LLAMA_ARGS "
                             "(e.g. \"\" or \"--spec-type ngram-mod\") on the same GGUF and threads")
    parser.add_argument("--llama-server-bin", help="llama-server to launch (default $LLAMA_SERVER or PATH)")
    parser.add_argument("--gguf", help="model file for --launch-llama-server (default: the GGUF of "
                        "--model, or of verispec's default model)")
    parser.add_argument("--threads", type=int, help="threads of a launched llama-server (default: "
                        "what `verispec serve` would use on this machine)")
    parser.add_argument("--fresh-server-per-request", action="store_true",
                        help="with --launch-llama-server: a new server for every request (its "
                             "n-gram modes learn across requests); needs --concurrency 1")
    parser.add_argument("--dataset", help=f"built-in name(s), comma-separated ({names}), or a "
                        ".jsonl file of {id, prompt} / {id, messages} records")
    parser.add_argument("--model", help="model id to request (default: first of /v1/models)")
    parser.add_argument("--config-name", default="default",
                        help="label of the server configuration measured, e.g. spec-k4 or baseline")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts per dataset, chosen by a seeded shuffle (default: all)")
    parser.add_argument("--passes", type=int, default=3, help="measured passes over the prompts")
    parser.add_argument("--warmup", type=int, default=2,
                        help="warm-up requests on prompts that are never measured")
    parser.add_argument("--seed", type=int, default=0, help="seeds selection, order and bootstrap")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0],
                        help="one value, or several for a sweep (one sub-run each)")
    parser.add_argument("--concurrency", type=int, default=1, help="conversations in flight")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds before one request is recorded as timed out")
    parser.add_argument("--out", help="new results directory (default bench_results/<name>-<time>)")
    parser.add_argument("--baseline-dir", help="a baseline run directory to compare against")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default $OPENAI_API_KEY); never written to results")
    parser.add_argument("--extra-body", default="{}",
                        help="JSON object merged into every request body, e.g. '{\"top_p\": 0.9}'")
    parser.add_argument("--metrics-url", help="Prometheus endpoint (default <server root>/metrics)")
    parser.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    parser.add_argument("--no-continuous-usage", action="store_true",
                        help="do not ask for usage in every chunk (per-chunk token counts are "
                        "then unavailable unless the server sends token_ids)")
    parser.add_argument("--request-seeds", action="store_true",
                        help="send a fixed seed per (prompt, turn) with every request")
    parser.add_argument("--bootstrap-resamples", type=int, default=2000)
    parser.add_argument("--require-identical", action="store_true",
                        help="exit 1 if any output differs from the baseline at temperature 0")
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild report.md for the existing run (or sweep) in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _config(args, temperature: float, out_dir: Path) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url, dataset=args.dataset, out_dir=str(out_dir), model=args.model,
        config_name=args.config_name, max_tokens=args.max_tokens, num_prompts=args.num_prompts,
        passes=args.passes, warmup=args.warmup, seed=args.seed, temperature=temperature,
        concurrency=args.concurrency, request_timeout_s=args.request_timeout,
        metrics_url=args.metrics_url, scrape_metrics=not args.no_metrics,
        continuous_usage=not args.no_continuous_usage, request_seeds=args.request_seeds,
        extra_body_json=args.extra_body, progress=not args.no_progress,
        launched_engine_args=getattr(args, "launch", None),
        launched_peer=getattr(args, "launched_peer", None),
        fresh_server_per_request=bool(getattr(args, "fresh_server_per_request", False)))


def _err(message: str) -> None:
    print(f"verispec bench: {message}", file=sys.stderr)


def _report(run_dir: Path, baseline: Path | None, args) -> int:
    """Build the report; 1 if the run is incomplete or (if required) outputs diverge."""
    path = build_report(run_dir, baseline, args.bootstrap_resamples, args.seed)
    manifest = json.loads((run_dir / RUN_FILE).read_text())
    print(f"report: {path}")
    code = 0
    if manifest["status"] != "complete":
        missing = manifest["missing"]
        _err(f"INCOMPLETE: {manifest['counts']['completed']}/{manifest['counts']['expected']} "
             f"requests completed; missing {len(missing)}:")
        for m in missing[:20]:
            _err(f"  pass {m['pass_index']} {m['dataset']}/{m['prompt_id']} turn {m['turn']}")
        code = 1
    if baseline is not None and args.require_identical:
        cmp = json.loads((run_dir / "comparison.json").read_text())
        divergences = cmp["equality"].get("divergences", [])
        if divergences:
            _err(f"{len(divergences)} outputs differ from the baseline at temperature 0")
            code = 1
    return code


def _baseline_for(args, sub: str | None) -> Path | None:
    if not args.baseline_dir:
        return None
    base = Path(args.baseline_dir) / sub if sub else Path(args.baseline_dir)
    if not (base / RUN_FILE).is_file():
        raise ProtocolError(f"--baseline-dir: {base} holds no {RUN_FILE}")
    return base


def _report_only(args) -> int:
    if not args.out:
        raise ProtocolError("--report-only needs --out pointing at an existing run")
    out = Path(args.out)
    if (out / RUN_FILE).is_file():
        return _report(out, _baseline_for(args, None), args)
    subs = sorted(d for d in out.iterdir() if (d / RUN_FILE).is_file()) if out.is_dir() else []
    if not subs:
        raise ProtocolError(f"--out {out} holds no run ({RUN_FILE}) and no sub-runs")
    codes = [_report(d, _baseline_for(args, d.name) if args.baseline_dir else None, args)
             for d in subs]
    print(f"sweep report: {build_sweep_report(out, subs)}")
    return max(codes)


def _run_all(args) -> int:
    targets = [t for t in (args.base_url, args.launch, args.launch_llama_server) if t is not None]
    if len(targets) > 1:
        raise ProtocolError("give one of --base-url, --launch and --launch-llama-server")
    if args.fresh_server_per_request and (args.launch_llama_server is None or args.concurrency != 1):
        raise ProtocolError("--fresh-server-per-request needs --launch-llama-server and --concurrency 1")
    if args.launch is not None:
        from verispec.bench.launch import launched_server
        with launched_server(args.launch) as base_url:
            args.base_url = base_url
            return _run_all_at(args)
    if args.launch_llama_server is not None:
        return _run_llama_server(args)
    return _run_all_at(args)


def _run_llama_server(args) -> int:
    from verispec.bench.client import OpenAIHTTPBackend
    from verispec.bench.launch import FreshServerBackend, launched_llama_server, llama_server_spec
    spec = llama_server_spec(args.launch_llama_server, args.llama_server_bin, args.gguf or args.model,
                             args.threads, args.concurrency)
    args.launched_peer = " ".join(spec.command(0)).replace(" --port 0", "")
    if args.fresh_server_per_request:
        args.base_url = "http://127.0.0.1/fresh-server-per-request"  # each request has its own port
        args.no_metrics = True
        return _run_all_at(args, FreshServerBackend(spec, args.api_key, args.request_timeout,
                                                    not args.no_continuous_usage))
    with launched_llama_server(spec) as base_url:
        args.base_url = base_url
        return _run_all_at(args, OpenAIHTTPBackend(base_url, args.api_key, args.request_timeout,
                                                   not args.no_continuous_usage, keepalive=False))


def _run_all_at(args, backend=None) -> int:
    if not args.base_url or not args.dataset:
        raise ProtocolError("--base-url (or --launch) and --dataset are required (or use --report-only)")
    out = Path(args.out or f"bench_results/{args.config_name}-{time.strftime('%Y%m%dT%H%M%S')}")
    sweep = len(args.temperature) > 1
    if sweep and len(set(args.temperature)) != len(args.temperature):
        raise ValueError("--temperature lists a value twice")
    targets = [(t, out / f"temperature-{t:g}" if sweep else out) for t in args.temperature]
    configs = [(_config(args, t, d), d) for t, d in targets]  # validate every config first
    codes = []
    for config, run_dir in configs:
        sub = run_dir.name if sweep else None
        baseline = _baseline_for(args, sub)
        outcome = asyncio.run(run_benchmark(config, backend, api_key=args.api_key))
        print(f"run {outcome.manifest['run_id']}: {outcome.manifest['status']} "
              f"({outcome.manifest['counts']['completed']}/{outcome.manifest['counts']['expected']})")
        codes.append(_report(run_dir, baseline, args))
    if sweep:
        print(f"sweep report: {build_sweep_report(out, [d for _, d in configs])}")
    if backend is not None:
        asyncio.run(backend.aclose())
    return max(codes)


def main(args: argparse.Namespace) -> int:
    """Run `verispec bench` with parsed `args`; returns the process exit code."""
    try:
        return _report_only(args) if args.report_only else _run_all(args)
    except SchemaError as e:
        _err(f"schema violation, run failed: {e}")
        return 1
    except (DatasetError, ProtocolError, ValueError, RuntimeError) as e:
        _err(str(e))
        return 2


def _standalone(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verispec bench", description=__doc__)
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(_standalone())
