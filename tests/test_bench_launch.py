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
