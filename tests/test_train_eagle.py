"""`verispec train-draft eagle`'s stages on a tiny target: features, training, resumption, export.

The head's drafts and gates are in test_eagle.py; here the pipeline that makes a head.
"""
import pytest
import torch

from tiny import run_all, tiny_engine, tiny_pair
from verispec.model.eagle import load_head, save_head
from verispec.sampling import SamplingParams
from verispec.train import eagle as eagle_mod
from verispec.train.distill import lr_at, read_losses
from verispec.train.eagle import LR_FLOOR, EagleConfig, head_forward, init_head, run_features, run_train, teacher_rows
from verispec.train.store import load_torch, read_json, save_torch, write_json
from verispec.train.traces import score_topk

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
CFG = EagleConfig(num_draft_vocab=24, steps=60, tokens_per_step=256, lr=3e-3, warmup_steps=5,
                  checkpoint_every=30, eval_every=30)


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """(target, features dir, vocabulary, teacher rows) of 40 greedy traces, 8 held out."""
    target, _ = tiny_pair(vocab=48, noise=0.1, seed=3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 48, (6,), generator=g).tolist() for _ in range(40)]
    outs = run_all(tiny_engine(target, method="none"), prompts, GREEDY)
    records = [{"prompt_ids": torch.tensor(p, dtype=torch.int32),
                "output_ids": torch.tensor(o.token_ids, dtype=torch.int32)} for p, o in zip(prompts, outs)]
    score_topk(target, records, 8)
    root = tmp_path_factory.mktemp("eagle-train")
    filtered = root / "filtered"
    filtered.mkdir()
    save_torch(filtered / "train.pt", {"records": records[8:]})
    save_torch(filtered / "heldout.pt", {"records": records[:8]})
    write_json(filtered / "report.json", {"fingerprint": "tiny"})
    done = run_features(CFG, filtered, root / "features", target, progress=False)
    assert done["vocab"] == 24 and 0.5 < done["train_output_coverage"] <= 1.0
    vocab = read_json(root / "features" / "vocab.json")["vocab_ids"]
    return target, root / "features", vocab, teacher_rows(target, vocab)


def _train(features, train_dir):
    target, feats, vocab, teacher = features
    torch.manual_seed(CFG.seed)
    head = init_head(target, vocab)
    run_train(CFG, feats, train_dir, head, "tiny", teacher, False)
    return head


def test_training_raises_agreement_and_a_rerun_does_no_work(features, tmp_path):
    """The held-out agreement rises; a rerun with the same settings changes no file; one
    with other settings is refused, not mixed in."""
    _train(features, tmp_path / "train")
    done = read_json(tmp_path / "train" / "done.json")
    assert done["eval_last"]["greedy_agree"] > done["eval_first"]["greedy_agree"]
    files = {p.name: p.read_bytes() for p in (tmp_path / "train").iterdir()}
    assert _train(features, tmp_path / "train") is not None
    assert {p.name: p.read_bytes() for p in (tmp_path / "train").iterdir()} == files
    target, feats, vocab, teacher = features
    other_lr = EagleConfig(**{**CFG.to_dict(), "lr": 1e-3})
    with pytest.raises(ValueError, match=r"different settings \(config.lr"):
        run_train(other_lr, feats, tmp_path / "train", init_head(target, vocab), "tiny", teacher, False)
    half = EagleConfig(**{**CFG.to_dict(), "steps": 30})
    with pytest.raises(ValueError, match="ran to 60 steps; --steps must be more"):
        run_train(half, feats, tmp_path / "train", init_head(target, vocab), "tiny", teacher, False)


def test_a_finished_run_extends_with_a_fresh_schedule_from_its_last_weights(features, tmp_path):
    """A 30-step run asked for 60 resumes at step 31 with the warm-up's first rate, logs each
    step once and records both segments; an unfinished run is not extended."""
    target, feats, vocab, teacher = features
    short = EagleConfig(**{**CFG.to_dict(), "steps": 30})
    torch.manual_seed(CFG.seed)
    run_train(short, feats, tmp_path / "train", init_head(target, vocab), "tiny", teacher, False)
    first = read_json(tmp_path / "train" / "done.json")
    extended = _train(features, tmp_path / "train")
    done = read_json(tmp_path / "train" / "done.json")
    assert done["steps"] == 60 and done["schedule"] == [[0, 30], [30, 60]]
    log = [e for e in read_losses(tmp_path / "train" / "losses.jsonl") if "loss" in e]
    assert [e["step"] for e in log] == list(range(1, 61))
    assert log[29]["lr"] == pytest.approx(lr_at(29, short, LR_FLOOR))       # the first cosine's end
    assert log[30]["lr"] == pytest.approx(CFG.lr / CFG.warmup_steps)         # a fresh warm-up
    assert done["eval_last"]["greedy_agree"] >= first["eval_last"]["greedy_agree"]
    straight = _train(features, tmp_path / "straight")
    assert any(not torch.equal(a, b) for a, b in zip(straight.state_dict().values(), extended.state_dict().values()))
    (tmp_path / "train" / "done.json").unlink()
    longer = EagleConfig(**{**CFG.to_dict(), "steps": 90})
    with pytest.raises(ValueError, match="has not finished its 60 steps"):
        run_train(longer, feats, tmp_path / "train", init_head(target, vocab), "tiny", teacher, False)


def test_an_interrupted_run_resumes_to_the_same_weights_and_logs_each_step_once(features, tmp_path, monkeypatch):
    """Interrupted after step 41 (checkpoint at 30): the resumed run ends with the straight
    run's weights, and the log lines of steps 31-41 written before the crash are dropped."""
    straight = _train(features, tmp_path / "straight")
    real_log = eagle_mod.log_entry

    def crash_after_41(path, entry):
        real_log(path, entry)
        if entry["step"] == 41 and "loss" in entry:
            raise KeyboardInterrupt
    monkeypatch.setattr(eagle_mod, "log_entry", crash_after_41)
    with pytest.raises(KeyboardInterrupt):
        _train(features, tmp_path / "train")
    assert load_torch(tmp_path / "train" / "checkpoint.pt")["step"] == 30
    monkeypatch.setattr(eagle_mod, "log_entry", real_log)
    resumed = _train(features, tmp_path / "train")
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    steps = [e["step"] for e in read_losses(tmp_path / "train" / "losses.jsonl") if "loss" in e]
    assert steps == list(range(1, CFG.steps + 1))


def test_the_exported_head_computes_what_the_trained_head_computes_in_bf16(features, tmp_path):
    """save_head / load_head carry every trained weight: the loaded head's logits and
    features equal the trained head's with its weights rounded to bf16 (the file's dtype)."""
    target, feats, vocab, _ = features
    trained = _train(features, tmp_path / "train")
    save_head(trained, tmp_path / "head", {"target": "tiny"})
    loaded = load_head(tmp_path / "head").bind(target.embed_tokens)
    with torch.no_grad():
        for p in trained.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    record = load_torch(feats / "heldout.pt")["records"][0]
    ids, h = record["ids"].long()[None], record["h"].float()[None]
    (want_logits, want_g), (got_logits, got_g) = head_forward(trained, ids, h), head_forward(loaded, ids, h)
    assert loaded.vocab_ids.tolist() == vocab
    assert torch.equal(got_logits, want_logits) and torch.equal(got_g, want_g)
    assert not torch.equal(head_forward(init_head(target, vocab), ids, h)[0], want_logits)  # training changed it


def test_batched_features_equal_one_record_at_a_time(features):
    """Right-padding records of different lengths into one pass changes no feature."""
    target = features[0]
    g = torch.Generator().manual_seed(2)
    records = [{"prompt_ids": torch.randint(0, 48, (int(n),), generator=g, dtype=torch.int32),
                "output_ids": torch.randint(0, 48, (5,), generator=g, dtype=torch.int32),
                "topk_ids": torch.zeros(5, 2, dtype=torch.int32), "topk_logprobs": torch.zeros(5, 2)}
               for n in (3, 9, 1, 14)]
    together = eagle_mod.target_features(target, records, max_seq_len=16)
    for r, got in zip(records, together):
        alone = eagle_mod.target_features(target, [r], max_seq_len=16)[0]
        assert torch.equal(got["ids"], alone["ids"]) and got["first"] == alone["first"]
        assert torch.allclose(got["h"].float(), alone["h"].float(), atol=1e-2, rtol=1e-2)
