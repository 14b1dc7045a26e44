"""Schema of benchmark evidence: a valid record passes; every invalid kind fails naming its field."""
import copy
import json

import pytest

from verispec.bench.records import (REQUEST_SCHEMA, RecordWriter, SchemaError, read_records,
                                    validate_request_record, validate_run_manifest)


def valid_record() -> dict:
    return {
        "schema": REQUEST_SCHEMA, "run_id": "r1", "config_name": "spec", "pass_index": 0,
        "order_index": 0, "dataset": "gsm8k", "prompt_id": "7", "source_id": "gsm8k/test:7",
        "task": "math", "turn": 0, "num_turns": 1, "model": "m", "temperature": 0.0,
        "max_tokens": 64, "request_seed": None, "status": "ok", "error": None,
        "http_status": 200, "request_start_unix": 1.7e9, "prompt_tokens": 12,
        "completion_tokens": 6, "ttft_s": 0.05, "ttft_basis": "first_token_chunk",
        "e2e_s": 0.2, "tpot_s": 0.03, "first_chunk_tokens": 1, "decode_tokens_per_s": 40.0,
        "chunk_times_s": [0.05, 0.1, 0.18], "chunk_tokens": [1, 3, 2], "chunk_chars": [2, 9, 5],
        "chunk_token_semantics": "usage_delta", "itl_s": [0.05, 0.08],
        "output_text": "ab cdefghi jklmn", "finish_reason": "stop", "stream_done": True,
        "spec": {"drafted": 8, "accepted": 5}, "json_valid": None, "flags": [],
    }


def error_record() -> dict:
    r = valid_record()
    r.update(status="error", error={"kind": "http_status", "message": "HTTP 500",
                                    "http_status": 500, "body": "boom"},
             http_status=500, prompt_tokens=None, completion_tokens=None, ttft_s=None,
             ttft_basis=None, e2e_s=0.01, tpot_s=None, first_chunk_tokens=None,
             decode_tokens_per_s=None, chunk_times_s=[], chunk_tokens=[], chunk_chars=[],
             itl_s=[], output_text=None, finish_reason=None, stream_done=False)
    return r


def test_valid_ok_and_error_records_pass():
    validate_request_record(valid_record())
    validate_request_record(error_record())


INVALID = [
    # (mutation, field named in the message)
    (lambda r: r.pop("completion_tokens"), "completion_tokens"),
    (lambda r: r.update(completion_tokens=None), "completion_tokens"),      # missing usage
    (lambda r: r.update(completion_tokens="6"), "completion_tokens"),       # wrong type
    (lambda r: r.update(completion_tokens=True), "completion_tokens"),      # bool is not a count
    (lambda r: r.update(prompt_tokens=-1), "prompt_tokens"),
    (lambda r: r.update(schema="verispec.bench.request/v0"), "schema"),
    (lambda r: r.update(category="code"), "category"),                      # undeclared column
    (lambda r: r.update(chunk_token_semantics="words"), "chunk_token_semantics"),
    (lambda r: r.update(chunk_tokens=[1, 3]), "chunk_tokens"),              # length mismatch
    (lambda r: r.update(chunk_tokens=[1, 3, 1]), "chunk_tokens"),           # sum != usage
    (lambda r: r.update(chunk_tokens=[1, None, 2]), "chunk_tokens"),        # null but exact
    (lambda r: r.update(chunk_times_s=[0.1, "x", 0.2]), "chunk_times_s"),
    (lambda r: r.update(status="done"), "status"),
    (lambda r: r.update(ttft_s=None), "ttft_s"),
    (lambda r: r.update(output_text=None), "output_text"),
    (lambda r: r.update(finish_reason=None), "finish_reason"),
    (lambda r: r.update(turn=1), "turn"),                                   # turn >= num_turns
    (lambda r: r.update(pass_index=-1), "pass_index"),
    (lambda r: r.update(dataset=""), "dataset"),
    (lambda r: r.update(flags="x"), "flags"),
    (lambda r: r.update(error={"kind": "http_status"}), "error"),           # error on an ok row
]


@pytest.mark.parametrize("mutate,field", INVALID, ids=[f for _, f in INVALID])
def test_invalid_record_fails_naming_the_field(mutate, field):
    r = valid_record()
    mutate(r)
    with pytest.raises(SchemaError, match=repr(field)):
        validate_request_record(r)


@pytest.mark.parametrize("error,field", [
    (None, "error"),
    ({"kind": "http_status", "message": "x", "http_status": 500}, "error.body"),
    ({"kind": "oops", "message": "x", "http_status": None, "body": None}, "error.kind"),
    ({"kind": "timeout", "message": 3, "http_status": None, "body": None}, "error.message"),
])
def test_invalid_error_object_fails_naming_the_field(error, field):
    r = error_record()
    r["error"] = error
    with pytest.raises(SchemaError, match=repr(field)):
        validate_request_record(r)


def test_writer_refuses_invalid_record_and_writes_nothing(tmp_path):
    path = tmp_path / "records.jsonl"
    with RecordWriter(path) as w:
        w.write(valid_record())
        bad = valid_record()
        bad["completion_tokens"] = None
        with pytest.raises(SchemaError, match="completion_tokens"):
            w.write(bad)
    assert len(path.read_text().splitlines()) == 1
    assert read_records(path)[0]["prompt_id"] == "7"


def test_read_records_revalidates_and_names_the_line(tmp_path):
    bad = valid_record()
    del bad["ttft_s"]
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(valid_record()) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(SchemaError, match=r"records.jsonl:2: .*'ttft_s'"):
        read_records(path)


def _manifest():
    return {"schema": "verispec.bench.run/v1", "run_id": "r", "config_name": "c",
            "status": "complete", "started_unix": 1.0, "finished_unix": 2.0, "config": {},
            "api_key_set": False, "model": "m", "server_models": [], "versions": {}, "git": {},
            "machine": {}, "datasets": [], "selection": {}, "warmup": {},
            "counts": {"expected": 2, "completed": 2, "failed": 0, "records": 2},
            "missing": [], "errors": [], "pass_wall_s": [1.0], "metrics": {}}


def test_run_manifest_cannot_claim_complete_with_missing_requests():
    validate_run_manifest(_manifest())
    m = copy.deepcopy(_manifest())
    m["counts"]["completed"] = 1
    m["missing"] = [{"pass_index": 0, "dataset": "d", "prompt_id": "p", "turn": 0}]
    with pytest.raises(SchemaError, match="'status'"):
        validate_run_manifest(m)
    m["status"] = "incomplete"
    validate_run_manifest(m)
