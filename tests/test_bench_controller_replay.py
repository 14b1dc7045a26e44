"""bench/controller_replay.py: a recording of controller calls replays to the same decisions
on the same controller file, and a changed controller is caught."""
from __future__ import annotations

import json
from pathlib import Path

from bench_scripts import load
from verispec.spec import controller as ctl_mod
from verispec.spec.controller import AdaptiveController, ControllerConfig

replay = load("controller_replay", "bench_controller_replay")
SOURCE = Path(ctl_mod.__file__)


def _recording(tmp_path: Path) -> Path:
    """Two requests at batch 2 over 60 rounds, drafting paying (cheap verify passes, high
    acceptance), recorded as the engine's calls would be."""
    ctl = AdaptiveController(ControllerConfig())
    calls = replay.tape(ctl)
    ids = ["a", "b"]
    for rid in ids:
        ctl.start(rid, "ngram")
    for _ in range(60):
        ks = ctl.choose_k(ids, 2, available=[4, 4], matches=[3, 3])
        ctl.observe_cost("choice", 2, 2, 1e-6)  # (too small to move a decision)
        for rid in ids:
            ctl.observe_acceptance(rid, ks[rid], ks[rid] if ks[rid] < 3 else 2, match=3)
        ctl.observe_cost("verify", 2, sum(ks.values()), 0.010 + 0.0005 * sum(ks.values()))
    for rid in ids:
        ctl.finish(rid, 60, ended_early=False)
    assert any(k for name, _, _, answer in calls if name == "choose_k" for k in answer.values())
    path = tmp_path / "rec.json"
    path.write_text(json.dumps({"benchmark": "controller-replay", "calls": calls,
                                "controller_config": ctl.config.to_dict()}))
    return path


def test_the_same_controller_replays_to_the_recorded_decisions(tmp_path, capsys):
    rec = _recording(tmp_path)
    assert replay.main(["compare", str(SOURCE), str(SOURCE), str(rec), "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert "rec.json: 60 rounds;" in out and "recorded decisions: old same, new same" in out


def test_a_controller_that_decides_otherwise_is_reported(tmp_path, capsys):
    """Broken: choose_k answers plain for every row: the replay says DIFFERENT and fails."""
    rec = _recording(tmp_path)
    text = SOURCE.read_text()
    assert "        return dict(zip(request_ids, ks))\n" in text
    broken = tmp_path / "controller_broken.py"
    broken.write_text(text.replace("        return dict(zip(request_ids, ks))\n",
                                   "        return dict(zip(request_ids, [0] * len(ks)))\n"))
    assert replay.main(["compare", str(SOURCE), str(broken), str(rec), "--reps", "1"]) == 1
    assert "old same, new DIFFERENT" in capsys.readouterr().out


def test_an_older_controller_replays_a_recording_with_choice_reports(tmp_path, capsys):
    """A controller from before the engine timed the choice apart rejects kind "choice":
    the replay leaves those reports out for it (without that, a ValueError)."""
    rec = _recording(tmp_path)
    text = SOURCE.read_text()
    new_kinds = 'COST_KINDS = ("verify", "draft", "catch_up", "choice")\n'
    assert new_kinds in text
    older = tmp_path / "controller_older.py"
    priced = 'choosing = self.estimated_cost("choice", batch_size, 1) or 0.0\n'
    assert priced in text
    older.write_text(text.replace(new_kinds, 'COST_KINDS = ("verify", "draft", "catch_up")\n')
                     .replace(priced, "choosing = 0.0\n"))
    assert replay.main(["compare", str(older), str(SOURCE), str(rec), "--reps", "1"]) == 0
    assert "rec.json: 60 rounds;" in capsys.readouterr().out


def test_an_older_controller_replays_a_recording_with_output_lengths(tmp_path, capsys):
    """A controller from before the engine reported each finished request's length takes
    `finish(request_id)` alone: the replay passes it the id only (without that, a TypeError)."""
    rec = _recording(tmp_path)
    text = SOURCE.read_text()
    new_finish = ("    def finish(self, request_id: str, output_tokens: int | None = None, "
                  "ended_early: bool = False) -> None:\n")
    assert new_finish in text
    older = tmp_path / "controller_older.py"
    older.write_text(text.replace(new_finish, "    def finish(self, request_id: str) -> None:\n"
                                              "        output_tokens, ended_early = None, False\n"))
    assert replay.main(["compare", str(older), str(SOURCE), str(rec), "--reps", "1"]) == 0
    assert "rec.json: 60 rounds;" in capsys.readouterr().out
