"""End to end over loopback HTTP: a fake OpenAI-compatible server that misbehaves on purpose."""
import json

import pytest

from verispec.bench import cli
from verispec.bench.fake_server import Behaviour, FakeServer
from verispec.bench.protocol import runner
from verispec.bench.protocol.runner import pass_order
from verispec.bench.records import read_run


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question number {i}"}) + "\n"
                            for i in range(6)))
    return path


def run(server, out, dataset, *extra, passes=2, num=4, warmup=2):
    args = ["--base-url", server.base_url, "--dataset", str(dataset), "--num-prompts", str(num),
            "--passes", str(passes), "--warmup", str(warmup), "--out", str(out), "--no-progress",
            *extra]
    return cli._standalone(args)


def user_text(body):
    return body["messages"][0]["content"]


def test_well_behaved_server_gives_complete_evidence(tmp_path, dataset):
    with FakeServer() as server:
        code = run(server, tmp_path / "run", dataset)
        received = [user_text(b) for b in server.behaviour.received]
    assert code == 0
    manifest, records = read_run(tmp_path / "run")
    assert manifest["status"] == "complete" and len(records) == 8
    assert manifest["counts"] == {"expected": 8, "completed": 8, "failed": 0, "records": 8}
    assert manifest["git"]["commit"] and manifest["machine"]["logical_cores"]
    assert manifest["versions"]["httpx"] and manifest["config"]["passes"] == 2
    assert all(r["chunk_token_semantics"] == "usage_delta" for r in records)
    assert all(r["spec"] is not None and r["decode_tokens_per_s"] > 0 for r in records)
    # labelled counters (model_name, method) still give acceptance
    acc = manifest["metrics"]["acceptance"]
    assert 0 < acc["acceptance_rate"] < 1 and len(acc["per_position"]) == 3 and not acc["flags"]
    assert (tmp_path / "run" / "metrics_before.prom").read_text().startswith("# HELP")
    report = (tmp_path / "run" / "report.md").read_text()
    assert "8 / 8" in report and "Acceptance" in report
    for png in ("ttft_distribution", "tpot_distribution", "acceptance_per_position"):
        assert (tmp_path / "run" / "plots" / f"{png}.png").stat().st_size > 1000
    # warm-up prompts were sent first, are disjoint from the measured ones and never recorded
    warm_ids = {w["prompt_id"] for w in manifest["warmup"]["prompts"]}
    assert len(warm_ids) == 2 and not warm_ids & {r["prompt_id"] for r in records}
    assert {f"question number {i[1:]}" for i in warm_ids} == set(received[:2])
    assert not set(received[:2]) & set(received[2:])
    # each pass in its own seeded order, as sent
    measured_order = [[r["prompt_id"] for r in sorted(records, key=lambda r: r["order_index"])
                       if r["pass_index"] == p] for p in (0, 1)]
    assert received[2:6] == [f"question number {pid[1:]}" for pid in measured_order[0]]
    assert received[6:10] == [f"question number {pid[1:]}" for pid in measured_order[1]]


def test_pass_order_is_seeded_and_differs_between_passes():
    from verispec.bench.datasets import BenchPrompt
    prompts = tuple(BenchPrompt("d", str(i), str(i), ({"role": "user", "content": str(i)},))
                    for i in range(20))
    assert pass_order(prompts, 0, 0) == pass_order(prompts, 0, 0)
    assert pass_order(prompts, 0, 0) != pass_order(prompts, 0, 1)
    assert pass_order(prompts, 0, 0) != pass_order(prompts, 1, 0)


@pytest.mark.parametrize("behaviour,kind,missing_prompts", [
    (Behaviour(send_usage=False), "missing_usage", None),
    (Behaviour(fail_500_substrings=("number 1",)), "http_status", {"p1"}),
    (Behaviour(close_substrings=("number 1",)), "transport", {"p1"}),
    (Behaviour(truncate_substrings=("number 1",)), "stream_truncated", {"p1"}),
    (Behaviour(stall_substrings=("number 1",), stall_s=3.0), "timeout", {"p1"}),
], ids=["missing-usage", "http-500", "connection-closed", "stream-cut-short", "timeout"])
def test_misbehaving_server_fails_the_run_and_lists_what_is_missing(
        tmp_path, dataset, capsys, behaviour, kind, missing_prompts):
    with FakeServer(behaviour) as server:
        code = run(server, tmp_path / "run", dataset, "--request-timeout", "0.5", num=6, warmup=0)
    assert code == 1
    manifest, records = read_run(tmp_path / "run")
    assert manifest["status"] == "incomplete"
    errors = [r for r in records if r["status"] == "error"]
    assert errors and all(r["error"]["kind"] == kind for r in errors)
    assert len(records) == 12  # failed requests are recorded, never dropped
    missing = {m["prompt_id"] for m in manifest["missing"]}
    if missing_prompts is not None:
        assert missing == missing_prompts and len(manifest["missing"]) == 2
    if kind == "http_status":
        assert errors[0]["error"]["http_status"] == 500 and "injected" in errors[0]["error"]["body"]
    stderr = capsys.readouterr().err
    assert "INCOMPLETE" in stderr and "p1" in stderr or missing_prompts is None
    assert "INCOMPLETE RUN" in (tmp_path / "run" / "report.md").read_text()


def test_zero_acceptance_counters_report_zero(tmp_path, dataset):
    with FakeServer(Behaviour(accept_tokens=False)) as server:
        assert run(server, tmp_path / "run", dataset) == 0
    acc = read_run(tmp_path / "run")[0]["metrics"]["acceptance"]
    assert acc["num_accepted_tokens"] == 0 and acc["acceptance_rate"] == 0.0
    assert acc["num_draft_tokens"] > 0


def test_missing_spec_counters_report_none_with_a_flag(tmp_path, dataset):
    with FakeServer(Behaviour(metrics_prefix=None)) as server:
        assert run(server, tmp_path / "run", dataset) == 0
    acc = read_run(tmp_path / "run")[0]["metrics"]["acceptance"]
    assert acc["acceptance_rate"] is None and acc["num_draft_tokens"] is None
    assert acc["flags"] == ["spec_metrics_missing"]
    assert "spec_metrics_missing" in (tmp_path / "run" / "report.md").read_text()


def test_unreachable_metrics_endpoint_is_flagged_not_fatal(tmp_path, dataset):
    with FakeServer(Behaviour(metrics_status=404)) as server:
        assert run(server, tmp_path / "run", dataset) == 0
    acc = read_run(tmp_path / "run")[0]["metrics"]["acceptance"]
    assert acc["acceptance_rate"] is None and "scrape_failed:before" in acc["flags"]


def test_second_turn_is_sent_after_the_first_answer(tmp_path):
    path = tmp_path / "mt.jsonl"
    path.write_text(json.dumps({"id": "c", "prompt": "first question",
                                "followups": ["second question"]}) + "\n")
    with FakeServer() as server:
        assert run(server, tmp_path / "run", path, passes=1, num=1, warmup=0) == 0
        bodies = server.behaviour.received
    _, records = read_run(tmp_path / "run")
    first = next(r for r in records if r["turn"] == 0)
    assert [len(b["messages"]) for b in bodies] == [1, 3]
    assert bodies[1]["messages"][1] == {"role": "assistant", "content": first["output_text"]}
    assert bodies[1]["messages"][2] == {"role": "user", "content": "second question"}
    assert {r["num_turns"] for r in records} == {2}


def test_concurrent_run_completes_every_request(tmp_path, dataset):
    with FakeServer() as server:
        assert run(server, tmp_path / "run", dataset, "--concurrency", "4", num=6, passes=3) == 0
    manifest, records = read_run(tmp_path / "run")
    assert manifest["counts"]["completed"] == 18 and len(records) == 18


def test_paired_comparison_flags_the_diverging_prompt(tmp_path, dataset, capsys):
    with FakeServer() as server:
        assert run(server, tmp_path / "base", dataset, "--config-name", "baseline", num=6) == 0
    with FakeServer(Behaviour(diverge_substrings=("number 2",))) as server:
        code = run(server, tmp_path / "spec", dataset, "--config-name", "spec", "--baseline-dir",
                   str(tmp_path / "base"), "--require-identical", num=6)
    assert code == 1
    assert "differ from the baseline" in capsys.readouterr().err
    cmp = json.loads((tmp_path / "spec" / "comparison.json").read_text())
    assert {d["prompt_id"] for d in cmp["equality"]["divergences"]} == {"p2"}
    d = cmp["equality"]["divergences"][0]
    assert "DIVERGED" in d["spec_excerpt"] and d["token_index_at_least"] > 0
    assert cmp["config_differences"] == [] and cmp["equality"]["compared"] == 12
    assert (tmp_path / "spec" / "plots" / "speedup_by_task.png").exists()


def test_a_record_that_breaks_the_schema_fails_the_run(tmp_path, dataset, monkeypatch, capsys):
    real = runner.build_record

    def broken(ctx, result):
        record = real(ctx, result)
        del record["completion_tokens"]
        return record
    monkeypatch.setattr(runner, "build_record", broken)
    with FakeServer() as server:
        assert run(server, tmp_path / "run", dataset) == 1
    assert "schema violation" in capsys.readouterr().err
    assert not (tmp_path / "run" / "run.json").exists()


def test_existing_results_are_never_overwritten(tmp_path, dataset, capsys):
    with FakeServer() as server:
        assert run(server, tmp_path / "run", dataset, passes=1) == 0
        assert run(server, tmp_path / "run", dataset, passes=1) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_temperature_sweep_writes_acceptance_vs_temperature(tmp_path, dataset):
    with FakeServer() as server:
        assert run(server, tmp_path / "sweep", dataset, "--temperature", "0", "0.7",
                   passes=1, num=2) == 0
    assert (tmp_path / "sweep" / "temperature-0" / "report.md").exists()
    assert (tmp_path / "sweep" / "temperature-0.7" / "run.json").exists()
    assert (tmp_path / "sweep" / "plots" / "acceptance_vs_temperature.png").exists()
    assert "temperature" in (tmp_path / "sweep" / "report.md").read_text()


def test_bad_flags_exit_2_with_the_field_named(tmp_path, dataset, capsys):
    assert cli._standalone(["--base-url", "http://127.0.0.1:9/v1", "--dataset", str(dataset),
                            "--passes", "0", "--out", str(tmp_path / "x")]) == 2
    assert "passes must be >= 1" in capsys.readouterr().err
