"""Derived per-request numbers: tokens per chunk, TTFT, decode rate, TPOT, JSON validity."""
import pytest

from verispec.bench.client import ChunkEvent, StreamResult, _absorb_chunk, _completion_problem
from verispec.bench.measure import RequestContext, build_record, chunk_tokens, json_valid, timings
from verispec.bench.records import validate_request_record


def ev(t, text, cum=None, count=None, choice=True, finish=None):
    return ChunkEvent(t=t, text=text, usage_completion_tokens=cum, token_count=count,
                      has_choice=choice, finish_reason=finish)


def result(events, prompt_tokens=10, completion_tokens=6, e2e=0.5, **kw):
    r = StreamResult(start_unix=1.7e9, http_status=200, events=events, saw_done=True,
                     finish_reason="stop", e2e_s=e2e,
                     usage={"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens})
    for k, v in kw.items():
        setattr(r, k, v)
    return r


CTX = RequestContext(run_id="r", config_name="c", pass_index=0, order_index=0, dataset="d",
                     prompt_id="p", source_id="s", task=None, turn=0, num_turns=1, model="m",
                     temperature=0.0, max_tokens=16, request_seed=None)


def test_usage_deltas_give_exact_tokens_per_chunk():
    events = [ev(0.01, "", cum=0), ev(0.10, "a", cum=1), ev(0.20, "bcd", cum=4),
              ev(0.30, "ef", cum=6, finish="stop"), ev(0.31, "", cum=6, choice=False)]
    ct = chunk_tokens(result(events))
    assert ct.semantics == "usage_delta" and ct.tokens == [1, 3, 2]


def test_decode_rate_excludes_tokens_of_the_first_chunk():
    # first chunk carries 3 tokens at t=0.1; 3 more arrive by t=0.4: 3 tokens / 0.3 s
    events = [ev(0.10, "abc", cum=3), ev(0.25, "d", cum=4), ev(0.40, "ef", cum=6)]
    r = result(events, e2e=0.5)
    t = timings(chunk_tokens(r), 6, 0.5)
    assert t["ttft_s"] == 0.10 and t["first_chunk_tokens"] == 3
    assert t["decode_tokens_per_s"] == pytest.approx(3 / 0.3)
    assert t["tpot_s"] == pytest.approx((0.5 - 0.10) / 5)
    assert t["itl_s"] == pytest.approx([0.15, 0.15])


def test_server_token_ids_are_used_when_usage_is_not_per_chunk():
    events = [ev(0.1, "ab", count=2), ev(0.2, "c", count=1), ev(0.3, "", choice=False)]
    ct = chunk_tokens(result(events, completion_tokens=3))
    assert ct.semantics == "server_chunk_count" and ct.tokens == [2, 1]


def test_without_per_chunk_counts_the_decode_rate_is_unavailable_not_estimated():
    events = [ev(0.1, "two words"), ev(0.2, " and three more")]
    r = result(events, completion_tokens=9)
    record = build_record(CTX, r)
    validate_request_record(record)
    assert record["chunk_token_semantics"] == "unavailable"
    assert record["chunk_tokens"] == [None, None]
    assert record["decode_tokens_per_s"] is None and record["ttft_basis"] == "first_text_chunk"
    assert "decode_rate_unavailable_no_chunk_counts" in record["flags"]
    assert record["completion_tokens"] == 9  # from usage, never from words


def test_per_chunk_counts_that_disagree_with_final_usage_are_dropped_and_flagged():
    events = [ev(0.1, "a", cum=1), ev(0.2, "b", cum=2)]
    ct = chunk_tokens(result(events, completion_tokens=5))
    assert ct.semantics == "unavailable" and ct.flags == ("chunk_usage_inconsistent",)


def test_record_of_a_good_stream_validates():
    events = [ev(0.05, "", cum=0), ev(0.1, "ab", cum=2), ev(0.2, "cdef", cum=6, finish="stop")]
    record = build_record(CTX, result(events, spec={"drafted": 4, "accepted": 3}))
    validate_request_record(record)
    assert record["spec"] == {"drafted": 4, "accepted": 3} and record["status"] == "ok"


@pytest.mark.parametrize("kw,kind", [
    ({"saw_done": False}, "stream_truncated"),
    ({"finish_reason": None}, "no_finish_reason"),
    ({"usage": None}, "missing_usage"),
    ({"usage": {"prompt_tokens": 3}}, "missing_usage"),
])
def test_incomplete_streams_are_errors(kw, kind):
    r = result([ev(0.1, "ab", cum=2)], completion_tokens=2, **kw)
    assert _completion_problem(r).kind == kind


def test_error_record_keeps_partial_evidence_and_validates():
    r = result([ev(0.1, "ab", cum=2)], completion_tokens=2, saw_done=False)
    r.error = _completion_problem(r)
    record = build_record(CTX, r)
    validate_request_record(record)
    assert record["status"] == "error" and record["error"]["kind"] == "stream_truncated"
    assert record["output_text"] == "ab" and record["decode_tokens_per_s"] is None


def test_chunk_parser_reads_usage_spec_and_mid_stream_errors():
    r = StreamResult(start_unix=0.0)
    assert _absorb_chunk('{"choices":[{"delta":{"content":"x"},"finish_reason":null}],'
                         '"usage":{"prompt_tokens":3,"completion_tokens":1}}', 0.1, r)
    assert _absorb_chunk('{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1},'
                         '"spec":{"accepted":0}}', 0.2, r)
    assert r.events[0].usage_completion_tokens == 1 and r.spec == {"accepted": 0}
    assert not _absorb_chunk('{"error":{"message":"overloaded"}}', 0.3, r)
    assert r.error.kind == "http_status" and "overloaded" in r.error.body
    r2 = StreamResult(start_unix=0.0)
    assert not _absorb_chunk("{oops", 0.1, r2) and r2.error.kind == "bad_chunk"


@pytest.mark.parametrize("text,ok", [('{"a": 1}', True), ('```json\n{"a": [1, 2]}\n```', True),
                                     ('[1, 2]', True), ('Sure! {"a": 1}', False), ('{"a": ', False),
                                     ('"just a string"', False)])
def test_json_validity(text, ok):
    assert json_valid(text) is ok
