"""`verispec bench --launch`: the harness starts verispec's own server for the run."""
import json
import subprocess
import sys


def run_bench(tmp_path, launch: str):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"id": "a", "prompt": "Say hi."}\n{"id": "b", "prompt": "Name a colour."}\n')
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "verispec.cli", "bench", "--launch", launch, "--dataset", str(data),
                           "--max-tokens", "6", "--warmup", "0", "--passes", "1", "--no-progress",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    return proc, out


def test_launch_runs_the_benchmark_against_a_local_verispec_server(tmp_path):
    proc, out = run_bench(tmp_path, "--dtype float32 --spec ngram")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for f in out.glob("*.jsonl") for line in f.read_text().splitlines()]
    assert len(records) == 2 and all(r["status"] == "ok" and r["completion_tokens"] >= 1 for r in records)
    assert all(isinstance(r["spec"], dict) for r in records)
    run = json.loads((out / "run.json").read_text())
    assert "--spec ngram" in json.dumps(run)


def test_launch_with_bad_engine_flags_fails_with_a_clear_message(tmp_path):
    proc, _ = run_bench(tmp_path, "--dtype float64")
    assert proc.returncode == 2
    assert "verispec serve" in proc.stderr and "Traceback" not in proc.stderr


def fake_llama_server(tmp_path):
    """An executable that runs tests/fake_llama_server.py with this interpreter; its log."""
    from pathlib import Path
    script = tmp_path / "llama-server"
    target = Path(__file__).resolve().parent / "fake_llama_server.py"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {target} \"$@\"\n")
    script.chmod(0o755)
    return script, tmp_path / "launches.jsonl"


def run_llama_bench(tmp_path, *flags: str):
    import os
    binary, log = fake_llama_server(tmp_path)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"id": "a", "prompt": "Say hi."}\n{"id": "b", "prompt": "Name a colour."}\n')
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "verispec.cli", "bench", "--llama-server-bin", str(binary),
                           "--dataset", str(data), "--max-tokens", "6", "--warmup", "0", "--passes", "1",
                           "--no-progress", "--out", str(out), *flags], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "FAKE_LLAMA_SERVER_LOG": str(log)})
    launches = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, out, launches


def test_launch_llama_server_runs_the_peer_on_the_same_gguf_and_threads(tmp_path):
    from verispec.config import auto_threads
    proc, out, launches = run_llama_bench(tmp_path, "--launch-llama-server", "")
    assert proc.returncode == 0, proc.stderr
    assert len(launches) == 1
    argv = launches[0]
    assert argv[argv.index("-m") + 1].endswith(".gguf") and "--jinja" in argv
    assert argv[argv.index("-t") + 1] == argv[argv.index("-tb") + 1] == str(auto_threads("serve"))
    run = json.loads((out / "run.json").read_text())
    assert "llama-server" in run["config"]["launched_peer"] or str(tmp_path) in run["config"]["launched_peer"]


def test_fresh_server_per_request_starts_one_llama_server_for_each_request(tmp_path):
    """n-gram modes learn across requests: every measured request gets a new server (plus one
    to list the models). Sharing one server would log a single launch."""
    proc, out, launches = run_llama_bench(tmp_path, "--launch-llama-server", "--spec-type ngram-mod",
                                          "--fresh-server-per-request")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["status"] == "ok" for r in records)
    assert len(launches) == 1 + len(records)
    assert all(a[a.index("--spec-type") + 1] == "ngram-mod" for a in launches)
    assert json.loads((out / "run.json").read_text())["config"]["fresh_server_per_request"] is True


def test_fresh_server_per_request_needs_one_request_in_flight(tmp_path):
    proc, _, launches = run_llama_bench(tmp_path, "--launch-llama-server", "", "--fresh-server-per-request",
                                        "--concurrency", "4")
    assert proc.returncode == 2 and "--concurrency 1" in proc.stderr and launches == []
