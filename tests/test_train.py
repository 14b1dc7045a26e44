"""Draft training pipeline on a tiny random target: traces, filter, train, export.

Each stage is shown to do its job and to do no work when rerun; the filter's counts are
exact; distillation lowers the loss; an interrupted training resumes to the same weights;
the exported directory loads through verispec's loader with the trained model's logits.
"""
import json

import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models as tk_models

from tiny import tiny_engine, tiny_pair
from verispec.engine.runner import ModelRunner, RowInput
from verispec.model.llama import LlamaModel
from verispec.model.loader import load_model_files, resolve_model
from verispec.model.registry import ModelNotFound
from verispec.spec.compat import check_pair
from verispec.train import distill
from verispec.train.config import FilterConfig, TracesConfig, TrainConfig
from verispec.train.distill import evaluate, load_examples, run_train
from verispec.train.draft import build_draft, causal_forward
from verispec.train.export import export_draft, hf_state_dict
from verispec.train.filter import run_filter
from verispec.train.prompts import TrainPrompt, iter_json_array
from verispec.train.registry import MARKER, registered_draft
from verispec.train.store import load_torch, save_torch, write_json
from verispec.train.traces import run_traces

VOCAB, EOS = 24, 23
TRACES = TracesConfig(target="tiny", dtype="float32", num_prompts=6, max_prompt_tokens=64, max_tokens=10,
                      top_k_logprobs=4, shard_size=3, batch_size=4)


def letters(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return "".join(chr(97 + int(i)) for i in torch.randint(0, VOCAB - 1, (n,), generator=g))


PROMPTS = [TrainPrompt("tiny", f"p{i}", ({"role": "user", "content": letters(i, 5 + i)},)) for i in range(8)]


@pytest.fixture(scope="module")
def target():
    return tiny_pair(vocab=VOCAB, seed=5)[0]


@pytest.fixture(scope="module")
def traces(tmp_path_factory, target):
    work = tmp_path_factory.mktemp("work")
    summary = run_traces(TRACES, work / "traces", PROMPTS, tiny_engine(target, method="none", eos=EOS),
                         {"name": "tiny"}, progress=False)
    return work, summary


def test_traces_store_outputs_with_topk_logprobs_of_the_generating_target(traces):
    work, summary = traces
    assert summary.num_shards == 2 and summary.shards_run == 2 and summary.num_examples == 6
    records = [r for i in range(2) for r in load_torch(work / "traces" / f"shard-{i:05d}.pt")["records"]]
    assert [r["prompt_id"] for r in records] == [p.prompt_id for p in PROMPTS[:6]]
    for r in records:
        n = r["output_ids"].numel()
        assert n >= 1 and r["topk_ids"].shape == (n, 4) and r["topk_logprobs"].shape == (n, 4)
        lp = r["topk_logprobs"]
        assert (lp <= 0).all() and (lp[:, :-1] >= lp[:, 1:]).all()  # sorted log-probabilities
        assert torch.logsumexp(lp, -1).le(1e-5).all()                # a part of one distribution
        # Greedy generation: the top-1 of the scoring pass IS the token generated there, so the
        # stored positions line up with the outputs (an off-by-one shift breaks this).
        assert torch.equal(r["topk_ids"][:, 0], r["output_ids"])
    settings = json.loads((work / "traces" / "settings.json").read_text())
    assert settings["config"]["temperature"] == 0.0 and settings["config"]["top_k_logprobs"] == 4


def test_traces_rerun_does_no_work_and_regenerates_only_a_missing_shard(traces, target):
    work, _ = traces
    shard1 = work / "traces" / "shard-00001.pt"
    before = load_torch(shard1)["records"]
    mtime0 = (work / "traces" / "shard-00000.pt").stat().st_mtime_ns
    engine = tiny_engine(target, method="none", eos=EOS)
    again = run_traces(TRACES, work / "traces", PROMPTS, engine, {"name": "tiny"}, progress=False)
    assert again.shards_run == 0 and again.num_examples == 6
    shard1.unlink()
    redo = run_traces(TRACES, work / "traces", PROMPTS, engine, {"name": "tiny"}, progress=False)
    assert redo.shards_run == 1
    assert (work / "traces" / "shard-00000.pt").stat().st_mtime_ns == mtime0
    after = load_torch(shard1)["records"]
    assert all(torch.equal(a["output_ids"], b["output_ids"]) for a, b in zip(before, after))


def test_traces_refuse_to_mix_settings(traces, target):
    work, _ = traces
    changed = TracesConfig(**{**TRACES.to_dict(), "max_tokens": 11})
    with pytest.raises(ValueError, match="max_tokens"):
        run_traces(changed, work / "traces", PROMPTS, tiny_engine(target, method="none", eos=EOS),
                   {"name": "tiny"}, progress=False)


# ----------------------------------------------------------------------------- filter

BENCH = {"fakebench": ["Natalia sold clips to forty eight of her friends in April and then she sold half "
                       "as many clips in May how many clips did Natalia sell altogether"]}


def record(pid: str, prompt: str, output_ids: list[int], output_text: str = "fine words") -> dict:
    n = len(output_ids)
    return {"source": "t", "prompt_id": pid, "prompt_text": prompt, "prompt_ids": torch.tensor([1, 2, 3]),
            "output_ids": torch.tensor(output_ids), "output_text": output_text, "finish_reason": "stop",
            "topk_ids": torch.zeros(n, 2, dtype=torch.int32), "topk_logprobs": torch.zeros(n, 2)}


def write_traces(directory, records) -> None:
    directory.mkdir(parents=True)
    save_torch(directory / "shard-00000.pt", {"records": records})
    write_json(directory / "settings.json", {"config": {}})
    write_json(directory / "done.json", {"num_shards": 1})


def test_filter_counts_duplicate_degenerate_and_contaminated(tmp_path):
    varied = list(range(100, 140))
    records = [
        record("ok1", "Tell me about tides.", varied),
        record("dup", "  tell ME about   tides. ", varied),                                     # duplicate
        record("empty", "Say nothing.", [EOS], ""),                                               # empty
        record("loop", "Count.", [5, 6, 7] * 20),                                                 # loop
        record("contam", "Q: natalia sold clips to forty eight of her friends in april and then she "
                         "sold half as many", varied),                                            # 13 words
        record("near", "natalia sold clips to forty eight of her friends in april and", varied),  # 12 words
        record("contam-out", "Any story.", varied, "so she sold half as many clips in may how many "
                                                   "clips did natalia sell altogether"),          # in output
        record("ok2", "Write a haiku.", varied[::-1]),
    ]
    write_traces(tmp_path / "traces", records)
    cfg = FilterConfig(heldout_fraction=0.0)
    report, ran = run_filter(cfg, tmp_path / "traces", tmp_path / "filtered", [EOS], bench=BENCH)
    assert ran
    assert (report.num_traces, report.dropped_duplicate, report.dropped_empty, report.dropped_loop,
            report.dropped_contaminated, report.num_kept) == (8, 1, 1, 1, 2, 3)
    assert report.contaminated_by == {"fakebench": 2}
    kept = [r["prompt_id"] for r in load_torch(tmp_path / "filtered" / "train.pt")["records"]]
    assert kept == ["ok1", "near", "ok2"]
    saved = json.loads((tmp_path / "filtered" / "report.json").read_text())
    assert saved["dropped_loop"] == 1
    assert run_filter(cfg, tmp_path / "traces", tmp_path / "filtered", [EOS], bench=BENCH)[1] is False


def test_filter_refuses_unfinished_traces(tmp_path):
    (tmp_path / "traces").mkdir()
    with pytest.raises(ValueError, match="not finished"):
        run_filter(FilterConfig(), tmp_path / "traces", tmp_path / "filtered", [EOS], bench=BENCH)


def test_truncated_json_array_yields_complete_records_only():
    items = list(iter_json_array('[{"id": "a_0"}, {"id": "b_0"}, {"id": "c_0", "conv'))
    assert items == [{"id": "a_0"}, {"id": "b_0"}]


# ----------------------------------------------------------------------------- train + export

TRAIN = TrainConfig(layers=(0,), steps=12, tokens_per_step=24, lr=3e-3, warmup_steps=2,
                    checkpoint_every=4, eval_every=6)


@pytest.fixture(scope="module")
def filtered(traces):
    work, _ = traces
    run_filter(FilterConfig(heldout_fraction=0.0), work / "traces", work / "filtered", [EOS], bench=BENCH)
    return work


def fresh_draft(target) -> LlamaModel:
    torch.manual_seed(0)
    return build_draft(target.cfg, hf_state_dict(target), TRAIN.layers)


@pytest.fixture(scope="module")
def trained(filtered, target):
    model = fresh_draft(target)
    done, ran = run_train(TRAIN, filtered / "filtered", filtered / "train", model, "tiny", progress=False)
    assert ran
    return filtered, model


def test_distillation_lowers_the_loss_and_saves_curve_and_checkpoint(trained, target):
    work, model = trained
    examples = load_examples(work / "filtered" / "train.pt", TRAIN)
    before = evaluate(fresh_draft(target), examples, TRAIN)
    after = evaluate(model, examples, TRAIN)
    assert after["loss"] < 0.8 * before["loss"], (before, after)
    assert (work / "train" / "loss.png").stat().st_size > 1000
    assert load_torch(work / "train" / "checkpoint.pt")["step"] == TRAIN.steps
    # Frozen by default: the LM head (and embeddings) stay the target's.
    assert torch.equal(model.lm_head.weight, target.lm_head.weight)


def test_training_rerun_does_no_work(trained, target):
    work, _ = trained
    assert run_train(TRAIN, work / "filtered", work / "train", fresh_draft(target), "tiny", progress=False)[1] is False


def test_interrupted_training_resumes_to_the_same_weights(trained, target, tmp_path, monkeypatch):
    work, straight = trained
    real_step, calls = distill.train_step, []

    def crash_after_six(*args, **kwargs):
        if len(calls) == 6:
            raise KeyboardInterrupt
        calls.append(1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(distill, "train_step", crash_after_six)
    with pytest.raises(KeyboardInterrupt):
        run_train(TRAIN, work / "filtered", tmp_path / "train", fresh_draft(target), "tiny", progress=False)
    assert load_torch(tmp_path / "train" / "checkpoint.pt")["step"] == 4  # last checkpoint before the crash
    monkeypatch.setattr(distill, "train_step", real_step)
    resumed = fresh_draft(target)
    run_train(TRAIN, work / "filtered", tmp_path / "train", resumed, "tiny", progress=False)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    steps = [e["step"] for e in distill.read_losses(tmp_path / "train" / "losses.jsonl") if "loss" in e]
    assert steps == list(range(1, TRAIN.steps + 1))  # no step logged twice


def write_target_dir(target, path) -> None:
    """The tiny target as an HF directory with a one-letter-per-token tokenizer."""
    backend = BackendTokenizer(tk_models.WordLevel({chr(97 + i): i for i in range(VOCAB)}, unk_token="a"))
    path.mkdir()
    backend.save(str(path / "tokenizer.json"))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    cfg = target.cfg
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False}))
    from safetensors.torch import save_file
    save_file(hf_state_dict(target), str(path / "model.safetensors"))


def test_export_round_trips_through_the_loader_with_the_same_logits(trained, target, tmp_path):
    _, model = trained
    write_target_dir(target, tmp_path / "target")
    out = export_draft(model, tmp_path / "target", tmp_path / "draft", {"note": "test"})
    assert (out / MARKER).is_file() and not list(tmp_path.glob("draft.building-*"))
    dcfg, dstate, dtok = load_model_files(resolve_model(str(out)))
    tcfg, _, ttok = load_model_files(resolve_model(str(tmp_path / "target")))
    assert check_pair(ttok, dtok, tcfg, dcfg).ok and dcfg.num_layers == 1
    loaded = LlamaModel.from_state_dict(dcfg, dstate, dtype=torch.float32)
    ids = [int(i) for i in torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1))]
    runner = ModelRunner(loaded, 64, 4)
    paged = runner.forward([RowInput(ids, 0, list(range(8)), 0)])[0]          # the engine's path
    with torch.no_grad():
        dense = model.lm_head(causal_forward(model, torch.tensor([ids]))[0])  # the training path
    assert torch.allclose(paged, dense, atol=1e-4), (paged - dense).abs().max()


def test_spec_draft_without_a_draft_model_uses_the_registered_draft(trained, target, tmp_path, monkeypatch):
    from verispec.config import EngineConfig, SpecConfig
    from verispec.engine.engine import LLMEngine
    from verispec.train import registry

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    write_target_dir(target, tmp_path / "target")
    monkeypatch.setitem(registry.DRAFTS, str(tmp_path / "target"), "tiny-draft")
    config = EngineConfig(model=str(tmp_path / "target"), dtype="float32", spec=SpecConfig(method="draft"))
    with pytest.raises(ModelNotFound, match="make draft"):   # registered, not trained yet
        LLMEngine.from_config(config)
    out = export_draft(trained[1], tmp_path / "target", registry.draft_dir(str(tmp_path / "target")), {})
    engine = LLMEngine.from_config(config)
    assert engine.config.draft_model == str(out) and "draft" in engine.proposers


def test_registered_draft_is_found_only_once_exported(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFound, match="make draft"):
        registered_draft("smollm2-135m-instruct")
    folder = tmp_path / "drafts" / "smollm2-135m-instruct-draft"
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("{}")
    assert registered_draft("smollm2-135m-instruct") == str(folder)
    with pytest.raises(ModelNotFound, match="no registered draft"):
        registered_draft("some-other-model")


# ----------------------------------------------------------------------------- gate

def test_gate_runs_every_method_losslessly_and_judges_by_the_rules():
    from verispec.train.gate import GateConfig, gate_verdict, markdown_table, run_gate

    target, draft = tiny_pair(vocab=VOCAB, noise=0.1, seed=2)
    # Fixed k: drafting is exercised whatever the tiny models' timings (adaptive k may park
    # at 0 when a tiny draft pass costs as much as a target pass).
    engine = tiny_engine(target, draft, method="draft", k=3, adaptive=False)
    prompts = {"chat-heldout": [[1, 2, 3, 1, 2], [4, 5, 6]], "code": [[7, 8, 9, 7, 8, 9]]}
    results = run_gate(engine, GateConfig(max_tokens=12), prompts, progress=lambda line: None)
    assert [r.task for r in results] == ["chat-heldout", "code"]
    assert all(r.mismatches == 0 for r in results)  # greedy speculation is lossless
    assert all(r.methods["draft"].drafted > 0 and r.methods["none"].drafted == 0 for r in results)
    assert "all tasks" in markdown_table(results)
    # The rule itself, on made-up speeds: faster than plain everywhere, than n-gram on chat.
    for r in results:
        for m, speed in (("none", 10.0), ("ngram", 11.0), ("draft", 12.0)):
            r.methods[m].tokens, r.methods[m].decode_s = int(speed * 10), 10.0
    assert gate_verdict(results) == (True, "PASS")
    results[1].methods["draft"].tokens = 90  # slower than plain on one task
    ok, why = gate_verdict(results)
    assert not ok and "plain on code" in why
