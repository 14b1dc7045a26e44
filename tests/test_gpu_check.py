"""scripts/gpu_check.py runs end to end (tiny shapes, on the CPU): the GPU machine gets one
try a session, so the script itself is checked here."""
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def test_gpu_check_writes_its_report_on_the_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "report.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--skip-tests", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    tiny = report["benchmark"]["tiny"]
    assert [d["batch"] for d in tiny["decode"]] == [1, 2] and all(d["tok_s"] > 0 for d in tiny["decode"])
    assert set(tiny["verify_ms_by_width"]) == {"1", "2", "4"}
    assert [t["batch"] for t in tiny["transformers"]] == [1, 2]


def test_gpu_check_names_what_is_missing(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.json"
    assert gpu_check.main(["--device", "cuda", "--out", str(out)]) == 2
    assert "CUDA device" in json.loads(out.read_text())["environment"]["missing"][0]
