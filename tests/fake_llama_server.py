"""A stand-in for llama.cpp's llama-server in tests: takes its flags, serves the fake engine.

Each start appends its argv to $FAKE_LLAMA_SERVER_LOG (one JSON list a line), so a test can
count how many servers a benchmark started and with what flags.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str]) -> int:
    log = os.environ.get("FAKE_LLAMA_SERVER_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(argv) + "\n")
    p = argparse.ArgumentParser()
    for flag in ("-m", "--host", "--port", "-t", "-tb", "-np", "-c", "--spec-type"):
        p.add_argument(flag)
    p.add_argument("--jinja", action="store_true")
    p.add_argument("--no-webui", action="store_true")
    args = p.parse_args(argv)
    if not Path(args.m).is_file():
        print(f"error: model file {args.m} not found", file=sys.stderr)
        return 1
    import fake_engine
    return fake_engine.main(["--host", args.host, "--port", args.port, "--step-delay", "0.001",
                             "--log-level", "warning", "--no-access-log"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
