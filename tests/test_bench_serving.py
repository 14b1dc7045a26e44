"""bench/serving.py end to end on tiny settings: every kind of contender runs, the served
engine's greedy outputs equal the in-process engine's (the fresh-server mode has its own test
in test_bench_launch.py)."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from test_bench_launch import fake_llama_server  # noqa: E402

import serving  # noqa: E402


def test_serving_benchmark_compares_server_inprocess_and_peer(tmp_path, monkeypatch):
    binary, log = fake_llama_server(tmp_path)
    monkeypatch.setenv("FAKE_LLAMA_SERVER_LOG", str(log))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Name {i} colours."}) + "\n"
                            for i in range(12)))
    out = tmp_path / "serving.json"
    assert serving.main(["--contenders", "inproc:none,serve:none,llama:plain",
                         "--datasets", str(data), "--prompts", "2", "--max-tokens", "6", "--repeats", "1",
                         "--serve-args", "--dtype float32", "--llama-server-bin", str(binary),
                         "--allow-noisy", "--wait-quiet-s", "0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())["results"][0]
    rows = {r["contender"]: r for r in result["summary"]}
    assert set(rows) == {"inproc:none", "serve:none", "llama:plain"}
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["serve:none"]["ratio_to_reference"] == 1.0  # the reference against itself
    assert rows["inproc:none"]["identical_to_reference"] == "2/2"  # served == in-process, greedy
    assert len(log.read_text().splitlines()) == 1  # one llama-server for all its runs


def test_eval_half_is_a_fixed_half_by_id():
    from verispec.bench.datasets import BenchPrompt
    prompts = [BenchPrompt("d", f"id{i}", f"id{i}", ({"role": "user", "content": "x"},)) for i in range(200)]
    half, tuning = serving.eval_half(prompts), serving.eval_half(prompts, evaluation=False)
    assert 70 < len(half) < 130 and half == serving.eval_half(list(reversed(prompts)))[::-1]
    assert not set(p.prompt_id for p in half) & set(p.prompt_id for p in tuning)
    assert len(half) + len(tuning) == len(prompts)
