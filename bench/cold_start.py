"""Cold start of `verispec generate` on the default model: launch to first token (issue 2).

Target: after the first run (which converts the GGUF and writes the runtime weights into
the cache), `verispec generate` prints its first token within 3 s of launch.

Each measured run is a fresh process (`.venv/bin/verispec generate --chat ...`, streaming
to a pipe); the clock starts just before the process is spawned and stops when the first
byte of generated text arrives on its stdout, and again when it exits. One unmeasured run
first makes sure the cache is populated. Contenders (weight formats) alternate run by run.

    .venv/bin/python bench/cold_start.py              # default format vs dense, 5 runs each
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PROMPT = "Name three colours."


def command(weight_format: str | None, max_tokens: int) -> list[str]:
    exe = str(Path(sys.executable).with_name("verispec"))
    cmd = [exe, "generate", "--chat", "--prompt", PROMPT, "--max-tokens", str(max_tokens)]
    return cmd + (["--weight-format", weight_format] if weight_format else [])


def one_run(cmd: list[str]) -> dict:
    """Seconds from spawn to the first stdout byte and to exit."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = os.read(proc.stdout.fileno(), 1)  # unbuffered: communicate() reads the fd itself
    t_first = time.perf_counter() - t0
    rest, err = proc.communicate()
    t_exit = time.perf_counter() - t0
    if proc.returncode != 0 or not first:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {err.decode()[-500:]}")
    return {"first_token_s": round(t_first, 3), "exit_s": round(t_exit, 3),
            "text": (first + rest).decode(errors="replace")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="measured runs per contender")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--formats", default="default,dense",
                   help="comma-separated --weight-format values; 'default' passes none")
    p.add_argument("--max-load", type=float, default=1.3)
    p.add_argument("--wait-quiet-s", type=float, default=300.0)
    p.add_argument("--allow-noisy", action="store_true")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "cold_start.json")
    args = p.parse_args(argv)
    args.threads = None
    formats = [None if f == "default" else f for f in args.formats.split(",")]
    configs = {}
    for fmt in formats:  # the first run converts and caches; not measured; its --json has the config
        first = one_run(command(fmt, args.max_tokens) + ["--json"])
        configs[fmt or "default"] = json.loads(first["text"].strip().splitlines()[-1])["config"]
    t0 = time.perf_counter()
    header = common.start_run(args)
    runs: dict[str, list[dict]] = {fmt or "default": [] for fmt in formats}
    for i in range(args.runs):
        for fmt in formats:
            r = one_run(command(fmt, args.max_tokens))
            r["load"] = round(common.load_average(), 2)
            runs[fmt or "default"].append(r)
            print(f"[cold-start] run {i} {fmt or 'default':8s} first token {r['first_token_s']:.2f} s, "
                  f"exit {r['exit_s']:.2f} s, load {r['load']:.2f}", file=sys.stderr, flush=True)
    rows = []
    for name, rs in runs.items():
        firsts = [r["first_token_s"] for r in rs]
        rows.append([name, len(rs), statistics.median(firsts), max(firsts),
                     statistics.median(r["exit_s"] for r in rs), "yes" if max(firsts) <= 3.0 else "NO"])
    text = common.markdown_table(["--weight-format", "runs", "first token s (median)", "first token s (max)",
                                  "exit s (median)", "max <= 3 s"], rows)
    print(text)
    payload = {"benchmark": "cold_start", "schema": "verispec.bench.cold-start/v1",
               **common.finish_run(header, t0),
               "settings": {"prompt": PROMPT, "max_tokens": args.max_tokens, "runs": args.runs,
                            "commands": {name: command(None if name == "default" else name, args.max_tokens)
                                         for name in runs},
                            "cache": os.environ.get("VERISPEC_CACHE", "~/.cache/verispec")},
               "engine_configs": configs,
               "runs": runs, "table_markdown": text}
    common.write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
