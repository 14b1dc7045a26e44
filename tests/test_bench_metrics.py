"""/metrics parsing keeps labels; counter deltas tell zero from missing."""
import pytest

from verispec.bench.metrics_scrape import (Scrape, acceptance, counter_delta, metrics_url_for,
                                           parse_metrics)


def exposition(prefix="verispec:", drafts=0, draft_tokens=0, accepted=0, per_pos=(),
               labels='model_name="m",method="eagle"'):
    lines = [f"# TYPE {prefix}spec_decode_num_drafts counter",
             f"{prefix}spec_decode_num_drafts_total{{{labels}}} {drafts}",
             f"# TYPE {prefix}spec_decode_num_draft_tokens counter",
             f"{prefix}spec_decode_num_draft_tokens_total{{{labels}}} {draft_tokens}",
             f"# TYPE {prefix}spec_decode_num_accepted_tokens counter",
             f"{prefix}spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}",
             f"# TYPE {prefix}spec_decode_num_accepted_tokens_per_pos counter"]
    lines += [f'{prefix}spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {v}'
              for i, v in enumerate(per_pos)]
    return "\n".join(lines) + "\n"


def scrape(text):
    return Scrape("http://x/metrics", 0.0, ok=True, http_status=200, text=text,
                  samples=parse_metrics(text))


def test_labelled_samples_are_found_by_name_with_labels_kept():
    samples = parse_metrics(exposition(draft_tokens=12))
    s = next(s for s in samples if s.name == "verispec:spec_decode_num_draft_tokens_total")
    assert s.value == 12 and dict(s.labels) == {"model_name": "m", "method": "eagle"}


def test_acceptance_from_labelled_counter_deltas():
    before = scrape(exposition(drafts=10, draft_tokens=30, accepted=15, per_pos=(9, 5, 1)))
    after = scrape(exposition(drafts=30, draft_tokens=90, accepted=45, per_pos=(27, 14, 4)))
    acc = acceptance(before, after)
    assert acc["prefix"] == "verispec:"
    assert (acc["num_draft_tokens"], acc["num_accepted_tokens"], acc["num_drafts"]) == (60, 30, 20)
    assert acc["acceptance_rate"] == pytest.approx(0.5)
    assert acc["mean_acceptance_length"] == pytest.approx(2.5)
    assert [(p["position"], p["accepted"], p["rate"]) for p in acc["per_position"]] == [
        (0, 18, 0.9), (1, 9, 0.45), (2, 3, 0.15)]
    assert acc["flags"] == []


def test_zero_acceptance_is_zero_not_missing():
    before = scrape(exposition(drafts=5, draft_tokens=15, accepted=0, per_pos=(0, 0, 0)))
    after = scrape(exposition(drafts=25, draft_tokens=75, accepted=0, per_pos=(0, 0, 0)))
    acc = acceptance(before, after)
    assert acc["num_accepted_tokens"] == 0 and acc["num_accepted_tokens"] is not None
    assert acc["acceptance_rate"] == 0.0
    assert [p["rate"] for p in acc["per_position"]] == [0.0, 0.0, 0.0]


def test_counters_that_did_not_move_give_zero_deltas_and_undefined_rate():
    text = exposition(drafts=7, draft_tokens=21, accepted=3, per_pos=(3,))
    acc = acceptance(scrape(text), scrape(text))
    assert acc["num_draft_tokens"] == 0 and acc["num_accepted_tokens"] == 0
    assert acc["acceptance_rate"] is None and "no_draft_tokens_in_run" in acc["flags"]


def test_missing_counter_is_none_with_a_flag_never_zero():
    text = "\n".join(l for l in exposition(drafts=1, draft_tokens=3, accepted=1).splitlines()
                     if "accepted_tokens_total" not in l) + "\n"
    acc = acceptance(scrape(text), scrape(text))
    assert acc["num_accepted_tokens"] is None and acc["acceptance_rate"] is None
    assert "missing:verispec:spec_decode_num_accepted_tokens_total" in acc["flags"]


def test_no_spec_metrics_at_all_is_flagged():
    text = "# TYPE up gauge\nup 1\n"
    acc = acceptance(scrape(text), scrape(text))
    assert acc["num_draft_tokens"] is None and acc["flags"] == ["spec_metrics_missing"]


def test_failed_scrape_is_flagged():
    bad = Scrape("http://x/metrics", 0.0, ok=False, error="HTTP 404")
    acc = acceptance(bad, scrape(exposition()))
    assert acc["acceptance_rate"] is None and acc["flags"] == ["scrape_failed:before"]


def test_vllm_prefix_is_accepted():
    acc = acceptance(scrape(exposition("vllm:", 0, 0, 0)), scrape(exposition("vllm:", 2, 6, 3)))
    assert acc["prefix"] == "vllm:" and acc["acceptance_rate"] == 0.5


def test_label_sets_are_summed_and_new_series_start_at_zero():
    before = scrape(exposition(draft_tokens=10, labels='model_name="a"'))
    after = scrape(exposition(draft_tokens=15, labels='model_name="a"')
                   + 'verispec:spec_decode_num_draft_tokens_total{model_name="b"} 4\n')
    d = counter_delta(before.samples, after.samples, "verispec:spec_decode_num_draft_tokens_total")
    assert d.total == 9
    assert "series_created_during_run:verispec:spec_decode_num_draft_tokens_total" in d.flags


def test_counter_reset_gives_none():
    d = counter_delta(parse_metrics(exposition(draft_tokens=10)), parse_metrics(exposition(draft_tokens=2)),
                      "verispec:spec_decode_num_draft_tokens_total")
    assert d.total is None and d.flags[0].startswith("counter_reset")


def test_metrics_url_is_the_server_root():
    assert metrics_url_for("http://h:8000/v1") == "http://h:8000/metrics"
    assert metrics_url_for("http://h:8000/v1/") == "http://h:8000/metrics"


def test_zero_vs_missing_check_catches_the_falsy_zero_bug(monkeypatch):
    """The post-mortem's bug (a zero delta treated as missing) must make the zero test fail."""
    from verispec.bench import metrics_scrape
    monkeypatch.setattr(metrics_scrape.CounterDelta, "total", property(
        lambda self: (sum(self.by_labels.values()) or None) if self.by_labels else None))
    with pytest.raises(AssertionError):
        test_zero_acceptance_is_zero_not_missing()


def test_label_check_catches_the_label_blind_lookup_bug(monkeypatch):
    """Keying samples by 'name{labels}' (the post-mortem's parser) must fail the label test."""
    from verispec.bench import metrics_scrape
    real = metrics_scrape.parse_metrics

    def label_blind(text):
        return [metrics_scrape.Sample(s.name + str(dict(s.labels)) if s.labels else s.name, (),
                                      s.value) for s in real(text)]
    monkeypatch.setitem(globals(), "parse_metrics", label_blind)
    with pytest.raises(AssertionError):
        test_acceptance_from_labelled_counter_deltas()
