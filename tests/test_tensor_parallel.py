"""Tensor parallelism (verispec.distributed) on CPU gloo: two real ranks against one process.

- the logits of TP = 2 equal one process's within float32 rounding, on a tiny Llama and a
  tiny Qwen2 (q/k/v biases, tied embeddings, a vocabulary that does not split evenly);
- greedy output is token-identical to one process's, plain and with both proposers;
- G1 (tests/test_gate_lossless.py's statistics) holds under TP = 2, and catches a head
  whose gathered vocabulary runs are put together in the wrong rank order;
- a killed rank fails the engine within a bound, naming the rank, over the engine API and
  over HTTP; a tensor_parallel_size the model cannot split is a clear error, no rank started.

torch.distributed has one default group per process, so one tensor-parallel engine is
alive at a time (`Engines`): the tests run in file order, grouped by the engine they use.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models as tk_models

from test_gate_lossless import (CHECKED, NUM_SAMPLES, PAIR, PROMPT, SEEDS, STATISTICAL_CHECKS, exact_joint,
                                statistical_checks)
from tiny import run_all
from verispec.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from verispec.distributed.layers import GatheredHead
from verispec.distributed.ranks import TensorParallelError
from verispec.engine.engine import LLMEngine
from verispec.engine.runner import RowInput
from verispec.model.config import ModelConfig
from verispec.model.llama import LlamaModel
from verispec.request import SpecOverride
from verispec.sampling import SamplingParams
from verispec.train.export import hf_state_dict

WORLD = 2
BUG_SAMPLES = 4_000     # the bug below moves whole distributions: a fifth of G1's samples show it


# ---------------------------------------------------------------------------- models on disk
def write_hf_dir(model: LlamaModel, path: Path, arch: str = "LlamaForCausalLM") -> Path:
    """`model` as a Hugging Face directory with a one-letter-per-token tokenizer."""
    cfg = model.cfg
    path.mkdir()
    vocab = {chr(0x4E00 + i): i for i in range(cfg.vocab_size)}
    BackendTokenizer(tk_models.WordLevel(vocab, unk_token=chr(0x4E00))).save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({
        "architectures": [arch], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings}))
    save_file(hf_state_dict(model), str(path / "model.safetensors"))
    return path


def tiny_qwen2() -> LlamaModel:
    """q/k/v biases, tied embeddings, 17 tokens (runs of 9 and 8), non-trivial norms."""
    cfg = ModelConfig(family="qwen2", vocab_size=17, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=256,
                      tie_word_embeddings=True, attention_bias=True, name="tiny-qwen2")
    torch.manual_seed(3)
    model = LlamaModel(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    target, draft = PAIR
    return {"llama": write_hf_dir(target, root / "llama"), "draft": write_hf_dir(draft, root / "draft"),
            "qwen2": write_hf_dir(tiny_qwen2(), root / "qwen2", "Qwen2ForCausalLM")}


def engine_config(model: Path, draft: Path | None = None, tp: int = 1, **kw) -> EngineConfig:
    """float32, one thread per rank, caches big enough for the gate's batch of requests."""
    return EngineConfig(model=str(model), draft_model=str(draft) if draft else None, dtype="float32",
                        threads=1, huge_pages=False, tensor_parallel_size=tp, seed=SEEDS[0],
                        spec=SpecConfig(method="ngram", num_spec_tokens=2, adaptive=False),
                        cache=CacheConfig(block_size=4, num_kv_tokens=(len(PROMPT) + 16) * 2048 * 2),
                        scheduler=SchedulerConfig(max_num_seqs=2048, max_num_batched_tokens=32768), **kw)


class Engines:
    """One tensor-parallel engine at a time (and its one-process twin), built on first use."""

    def __init__(self, dirs):
        self.dirs, self.name, self.pair = dirs, None, None

    def get(self, name: str) -> tuple[LLMEngine, LLMEngine]:
        """(TP = 2 engine, one-process engine) for the model `name`."""
        if name != self.name:
            self.close()
            draft = self.dirs["draft"] if name == "llama" else None
            one = LLMEngine.from_config(engine_config(self.dirs[name], draft))
            self.pair, self.name = (LLMEngine.from_config(engine_config(self.dirs[name], draft, WORLD)), one), name
        return self.pair

    def close(self) -> None:
        if self.pair is not None:
            self.pair[0].shutdown()
        self.name = self.pair = None


@pytest.fixture(scope="module")
def engines(dirs):
    e = Engines(dirs)
    yield e
    e.close()


# ---------------------------------------------------------------------------- GGUF blocks
def test_gguf_int4_groups_and_q8_0_head_are_sliced_like_the_weights():
    """What from_state_dict reads from a GGUF beside the state dict (Q4 groups, a Q8_0
    head) is sliced exactly as the dequantized weights are."""
    from verispec.distributed.sharding import RankShard
    from verispec.model.quant import quantize_int4
    cfg = ModelConfig(family="llama", vocab_size=11, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    weights = {"model.layers.0.self_attn.k_proj.weight": torch.randn(32, 64),    # rows
               "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 64),    # columns: whole groups
               "model.layers.0.mlp.down_proj.weight": torch.randn(64, 128)}
    scale, codes = torch.rand(11, 2), torch.randint(-127, 128, (11, 64), dtype=torch.int8)
    for rank in range(WORLD):
        shard = RankShard(cfg, rank, WORLD)
        sliced = shard.int4_groups({name: quantize_int4(w) for name, w in weights.items()})
        for name, w in weights.items():
            assert torch.equal(sliced[name].dequantize(), quantize_int4(w).dequantize()[shard.index(name, 2)])
        (lo, hi), (s, c) = shard.vocab_range, shard.q8_0_head(scale, codes)
        assert (lo, hi) == ((0, 6), (6, 11))[rank]
        assert torch.equal(s, scale[lo:hi]) and torch.equal(c, codes[lo:hi])


# ---------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
def test_greedy_output_is_token_identical_to_one_process(engines, method):
    prompts = [PROMPT[:9], PROMPT[3:20], [1, 2, 3, 1, 2, 3, 1, 2]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = SpecOverride(method, 0 if method == "none" else 3, False)
    tp, one = engines.get("llama")
    got = [o.token_ids for o in run_all(tp, prompts, params, spec)]
    want = [o.token_ids for o in run_all(one, prompts, params, spec)]
    assert got == want
    if method != "none":
        assert sum(o.spec.num_draft_tokens for o in run_all(tp, prompts[:1], params, spec)) > 0


# ---------------------------------------------------------------------------- G1 under TP = 2
def gate_run(engine: LLMEngine, method: str, k: int, params: SamplingParams, num: int) -> dict[str, bool]:
    """test_gate_lossless's checks on `num` TP samples, replicated on a second seed as the
    gate's decision rule wants; plus "acceptance" (the run drafted and accepted some)."""
    joint = exact_joint(PAIR[0], params, max(CHECKED) + 1)
    sp = replace(params, max_tokens=max(k + 2, max(CHECKED) + 1), ignore_eos=True)
    runs = []
    for seed in SEEDS:
        engine._shared_generator.manual_seed(seed)
        outs = run_all(engine, [PROMPT] * num, sp, SpecOverride(method, k, False), check=False)
        assert all(o.error is None for o in outs)
        samples = torch.tensor([o.token_ids[:max(CHECKED) + 1] for o in outs])
        drafted = sum(o.spec.num_draft_tokens for o in outs)
        rate = sum(o.spec.num_accepted_tokens for o in outs) / max(drafted, 1)
        runs.append((rate, statistical_checks(samples, joint)[0]))
        if all(runs[-1][1].values()):
            break
    verdict = {"acceptance": all(0.05 <= rate <= 0.98 for rate, _ in runs)}
    verdict.update({name: any(ok[name] for _, ok in runs) for name in STATISTICAL_CHECKS})
    return verdict


def test_g1_holds_under_tp2(engines):
    tp, _ = engines.get("llama")
    verdict = gate_run(tp, "draft", 2, SamplingParams(temperature=1.0), NUM_SAMPLES)
    assert [name for name, ok in verdict.items() if not ok] == []


def test_g1_catches_vocabulary_runs_gathered_in_the_wrong_rank_order(engines, monkeypatch):
    """Bug: rank 0 puts the ranks' logits together in reverse rank order (tokens of one run
    get the other run's logits). Every position's distribution is wrong from x1 on, so the
    first checked cell, x2, must fail both its checks; sampling itself still runs cleanly."""
    join = GatheredHead.join
    tp, _ = engines.get("llama")
    monkeypatch.setattr(GatheredHead, "join", lambda self, parts: join(self, parts[::-1]))
    verdict = gate_run(tp, "draft", 2, SamplingParams(temperature=1.0), BUG_SAMPLES)
    assert verdict["acceptance"]
    assert not verdict["x2 TV"] and not verdict["x2 chi2"], verdict


# ---------------------------------------------------------------------------- logits
ROWS = [  # a prefill of 9, a chunk continuing another row's context, a decode row
    [RowInput([1, 2, 3, 4, 5, 6, 7, 8, 9], 0, [0, 1, 2], 0), RowInput([9, 8, 7, 6], 0, [3], 0)],
    [RowInput([10, 11], 9, [0, 1, 2], 0), RowInput([5, 4, 3], 4, [3, 4], 1), RowInput([2], 0, [5], 0)],
]


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # qwen2 last: the next test kills it
def test_tp2_logits_equal_one_process_within_float32_rounding(engines, name):
    tp, one = engines.get(name)
    assert tp.target.kv.k.shape[2] == one.target.kv.k.shape[2] // WORLD  # each rank holds its KV heads
    before = tp.target.stats()
    for rows in ROWS:
        for got, want in zip(tp.target.forward(rows), one.target.forward(rows), strict=True):
            assert got.shape == want.shape and got.dtype == torch.float32
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    after = tp.target.stats()
    spent, waited = after.seconds - before.seconds, after.collective_seconds - before.collective_seconds
    assert after.forwards - before.forwards == len(ROWS) and 0 < waited < spent


# ---------------------------------------------------------------------------- failures
def _within(seconds: float, fn):
    """fn()'s exception (or None), failing the test if fn runs longer than `seconds`."""
    caught = []

    def run():
        try:
            fn()
        except BaseException as exc:
            caught.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    return caught[0] if caught else None


def test_a_killed_rank_stops_the_engine_naming_the_rank(engines):
    engine, _ = engines.get("qwen2")
    try:
        engine.add_request("long", [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True))
        engine.step()
        engine.step()
        worker = engine.target.group.workers[0]
        worker.process.send_signal(signal.SIGKILL)

        def step_until_failure():
            while engine.has_unfinished_requests():
                engine.step()
        exc = _within(15, step_until_failure)
        assert isinstance(exc, TensorParallelError), exc
        assert f"rank 1 (pid {worker.process.pid}) exited with signal SIGKILL" in str(exc)
        assert isinstance(_within(5, engine.step), TensorParallelError)  # and stays failed
    finally:
        engines.close()
    assert not dist.is_initialized()


def test_a_size_the_model_cannot_split_is_a_clear_error_before_any_rank_starts(engines, dirs, monkeypatch):
    from verispec.distributed import ranks
    engines.close()
    started = []
    monkeypatch.setattr(ranks.subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must divide the model's num_heads \(4\) "
                                         r"and num_kv_heads \(2\).*allowed values for .*: \[1, 2\]"):
        LLMEngine.from_config(engine_config(dirs["llama"], tp=3))
    assert started == [] and not dist.is_initialized()
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        engine_config(dirs["llama"], tp=0)


def _descendants(pid: int) -> list[int]:
    """Pids of every process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            found.append(child)
    return found


def _descendant_workers(pid: int) -> list[int]:
    """Pids of tensor-parallel worker processes below `pid`."""
    found = []
    for child in _descendants(pid):
        try:
            if b"verispec.distributed.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            pass
    return found


def test_a_killed_rank_fails_the_http_request_and_the_server_reports_it(dirs, tmp_path):
    from test_server_http import API_KEY, REPO, _free_port
    port = _free_port()
    log = (tmp_path / "server.log").open("w+")
    env = {**os.environ, "VERISPEC_API_KEY": API_KEY, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from verispec.cli import main; sys.exit(main())", "serve",
         "--model", str(dirs["qwen2"]), "--dtype", "float32", "-tp", "2", "--threads", "1", "--port", str(port),
         "--no-access-log", "--log-level", "warning", "--shutdown-timeout", "3", "--spec", "none"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None and time.monotonic() < deadline, log.seek(0) or log.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        [worker] = _descendant_workers(server.pid)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, timeout=20, max_retries=0)

        def stream():
            chunks = client.completions.create(model=str(dirs["qwen2"]), prompt=[1, 2, 3], max_tokens=240,
                                               temperature=1.0, stream=True)
            for i, _ in enumerate(chunks):
                if i == 2:
                    os.kill(worker, signal.SIGKILL)
        exc = _within(20, stream)
        assert isinstance(exc, openai.APIError), exc
        server.wait(20)  # a dead engine takes the server down (app.py: on_death), naming the cause
        log.seek(0)
        text = log.read()
        assert server.returncode != 0 and "exiting: engine core crashed: TensorParallelError" in text, text
        assert f"rank 1 (pid {worker}) exited with signal SIGKILL" in text, text
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


# ---------------------------------------------------------------------------- ranks by torchrun
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD)]


def _torchrun(args: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
    """`torchrun --standalone --nproc-per-node 2 -m verispec.cli ARGS`."""
    from test_server_http import REPO
    return subprocess.Popen([*TORCHRUN, "-m", "verispec.cli", *args], cwd=REPO, env={**os.environ, **(env or {})},
                            text=True, **kw)


def test_torchrun_ranks_generate_what_one_process_generates(dirs):
    """`torchrun --nproc-per-node 2 -m verispec.cli generate -tp 2`: rank 0 prints the
    one-process engine's greedy tokens; rank 1 runs its forwards, then both exit 0."""
    text = "".join(chr(0x4E00 + t) for t in [1, 2, 3, 4, 5, 1, 2, 3])
    proc = _torchrun(["generate", "--model", str(dirs["qwen2"]), "--dtype", "float32", "-tp", str(WORLD),
                      "--threads", "1", "--prompt", text, "--max-tokens", "16", "--spec", "ngram", "--json"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    one = LLMEngine.from_config(engine_config(dirs["qwen2"]))
    ids = list(one.tokenizer.encode(text))
    params = SamplingParams(temperature=0.0, max_tokens=16)
    assert result["token_ids"] == run_all(one, [ids], params, SpecOverride("ngram", 2, False))[0].token_ids


def test_torchrun_serves_http_from_rank_0_and_every_rank_stops_with_it(dirs):
    from test_server_http import API_KEY, _free_port
    port = _free_port()
    proc = _torchrun(["serve", "--model", str(dirs["qwen2"]), "--dtype", "float32", "-tp", str(WORLD),
                      "--threads", "1", "--port", str(port), "--no-access-log", "--log-level", "warning",
                      "--shutdown-timeout", "3", "--spec", "none"], {"VERISPEC_API_KEY": API_KEY},
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, timeout=30, max_retries=0)
        got = client.completions.create(model=str(dirs["qwen2"]), prompt=[1, 2, 3, 4], max_tokens=8, temperature=0)
        one = LLMEngine.from_config(engine_config(dirs["qwen2"]))
        want = run_all(one, [[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=8))[0].text
        assert got.choices[0].text == want
        ranks = _descendants(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)   # torchrun stops every rank, and exits
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    deadline = time.monotonic() + 10   # rank 0's engine core ends when it sees its parent gone
    while (left := [p for p in ranks if Path(f"/proc/{p}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(ranks) >= WORLD + 1 and not left, [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in left]


def test_torchrun_with_another_world_size_is_a_clear_error_on_every_rank(dirs):
    proc = _torchrun(["generate", "--model", str(dirs["qwen2"]), "--dtype", "float32", "--threads", "1", "-tp", "4",
                      "--prompt", "x", "--max-tokens", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "torchrun started 2 processes but tensor_parallel_size is 4" in err, err


def test_torchrun_runs_a_script_whose_llm_is_rank_0s(dirs, tmp_path):
    """A user script under torchrun: `LLM(..., tensor_parallel_size=2)` on every rank; rank 0
    gets the outputs (one process's), rank 1 ends inside the constructor after serving it."""
    script = tmp_path / "script.py"
    script.write_text(
        "import json, sys\n"
        "from verispec import LLM, SamplingParams\n"
        f"llm = LLM(model={str(dirs['qwen2'])!r}, tensor_parallel_size=2, dtype='float32', threads=1,\n"
        "          speculative_config={'method': 'none'})\n"
        "out = llm.generate([{'prompt_token_ids': [1, 2, 3, 4]}], SamplingParams(temperature=0, max_tokens=8))\n"
        "print('TOKENS', json.dumps(list(out[0].outputs[0].token_ids)))\n"
        "print('RANK 0 DONE')\n")
    from test_server_http import REPO
    proc = subprocess.run([*TORCHRUN, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("RANK 0 DONE") == 1, proc.stdout   # rank 1 never got past LLM(...)
    got = json.loads(proc.stdout.split("TOKENS", 1)[1].splitlines()[0])
    one = LLMEngine.from_config(engine_config(dirs["qwen2"]))
    assert got == run_all(one, [[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=8))[0].token_ids
