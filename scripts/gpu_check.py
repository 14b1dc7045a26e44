"""One prepared GPU check: the environment, the tests marked `gpu` on CUDA, and what a step
costs on random weights with the exact shapes of SmolLM2-135M and Qwen2.5-Coder-0.5B/1.5B.

Real weights cannot reach the GPU machine (no registry, 64 MiB from the tree), so acceptance
comes from the CPU runs and cost from here: plain decode tokens/s at batch 1, 8 and 32
through `LLMEngine` against the bandwidth roofline (bytes a step reads / measured
device-to-device copy bandwidth), the forward's time by verify width 1..16, and Hugging Face
`transformers` `generate` on the same shapes as the peer. CUDA graphs are not built yet:
the report says so rather than timing eager twice. Writes one JSON report; exits 1 when a
test failed, 2 when the environment lacks what the check needs (the report names it).

    python scripts/gpu_check.py --out gpu-check.json                 # on one H100: < 8 min
    python scripts/gpu_check.py --device cpu --quick --skip-tests    # the same code, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from verispec.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig  # noqa: E402
from verispec.engine.engine import LLMEngine  # noqa: E402
from verispec.engine.runner import ModelRunner, RowInput  # noqa: E402
from verispec.model.config import ModelConfig  # noqa: E402
from verispec.model.device import resolve_device  # noqa: E402
from verispec.model.llama import LlamaModel  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402
from verispec.train.export import hf_state_dict  # noqa: E402


def _shape(name, family, hidden, inter, layers, heads, kv, head_dim, vocab, theta, bias) -> ModelConfig:
    return ModelConfig(family=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                       rope_theta=theta, max_position_embeddings=4096, tie_word_embeddings=True,
                       attention_bias=bias, rms_norm_eps=1e-6, name=name)


# The published configs' shapes (config.json of each model).
SHAPES = {
    "smollm2-135m": _shape("smollm2-135m", "llama", 576, 1536, 30, 9, 3, 64, 49152, 1e5, False),
    "qwen2.5-coder-0.5b": _shape("qwen2.5-coder-0.5b", "qwen2", 896, 4864, 24, 14, 2, 64, 151936, 1e6, True),
    "qwen2.5-coder-1.5b": _shape("qwen2.5-coder-1.5b", "qwen2", 1536, 8960, 28, 12, 2, 128, 151936, 1e6, True),
}
QUICK = {"tiny": _shape("tiny", "qwen2", 64, 128, 2, 4, 2, 16, 512, 1e4, True)}


class IdTokenizer:
    """Token i <-> one character; what the engine needs of a tokenizer (no model files)."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.eos_token_ids, self.bos_token_id = vocab_size, (), None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + int(i) % 20000) for i in ids)


def environment(device: str) -> dict:
    """What the check runs on, and `missing`: what it needs and does not find."""
    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "device": device, "missing": []}
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            env["missing"].append("a CUDA device torch can use (torch.cuda.is_available() is False)")
        else:
            props = torch.cuda.get_device_properties(torch.device(device))
            env.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                       gpu_memory_gib=round(props.total_memory / 2**30, 1))
    for module in ("transformers", "pytest", "scipy"):
        try:
            env[module] = __import__(module).__version__
        except ImportError:
            env["missing"].append(f"python package {module}")
    return env


def run_gpu_tests(device: str, timeout_s: int) -> dict:
    """The tests marked `gpu`, on `device` (tests/tiny.py reads VERISPEC_TEST_DEVICE)."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "VERISPEC_TEST_DEVICE": device})
    except subprocess.TimeoutExpired as exc:
        return {"ok": False, "error": f"timed out after {timeout_s} s", "tail": (exc.stdout or "")[-3000:]}
    return {"ok": done.returncode == 0, "returncode": done.returncode, "seconds": round(time.perf_counter() - start, 1),
            "summary": (done.stdout.strip().splitlines() or [""])[-1], "tail": (done.stdout + done.stderr)[-3000:]}


def random_model(cfg: ModelConfig, device: torch.device) -> LlamaModel:
    """Random weights of `cfg`'s shapes, loaded through the real path (fused, bf16 body,
    float32 head) on `device`."""
    torch.manual_seed(0)
    with torch.device(device):
        source = LlamaModel(cfg)
    state = hf_state_dict(source, torch.bfloat16)
    del source
    return LlamaModel.from_state_dict(cfg, state, dtype=torch.bfloat16, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of 5."""
    src = torch.empty(mib * 2**20 // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def weight_bytes(model: LlamaModel) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def decode_throughput(model: LlamaModel, batch: int, prompt_len: int, new_tokens: int, bandwidth: float) -> dict:
    """Plain greedy decoding of `batch` random prompts through LLMEngine: tokens/s over the
    decode steps (the prefill step excluded) and the roofline at the mean context."""
    cfg, device = model.cfg, model.embed_tokens.weight.device
    config = EngineConfig(model=cfg.name, dtype="bfloat16", device=str(device), spec=SpecConfig(method="none"),
                          cache=CacheConfig(num_kv_tokens=batch * (prompt_len + new_tokens + 32)),
                          scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len))
    engine = LLMEngine(config, model, IdTokenizer(cfg.vocab_size))
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist(), params)
    engine.step()  # the prefill
    engine.step()  # the first decode step (lazy initialisation)
    _sync(device)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    _sync(device)
    seconds = time.perf_counter() - start
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    step_bytes = weight_bytes(model) + batch * (prompt_len + new_tokens / 2) * kv_per_token
    roofline = batch * bandwidth / step_bytes
    return {"batch": batch, "tokens": tokens, "tok_s": round(tokens / seconds, 1),
            "roofline_tok_s": round(roofline, 1), "of_roofline": round(tokens / seconds / roofline, 3)}


def step_by_width(model: LlamaModel, widths: list[int], context: int, repeats: int) -> dict:
    """Milliseconds of one forward of a single row verifying `width` tokens after `context`
    tokens of KV (the target pass of a speculative step), median of `repeats`."""
    device, block = model.embed_tokens.weight.device, 16
    blocks = -(-(context + max(widths)) // block)
    runner = ModelRunner(model, blocks * block, block)
    table = list(range(blocks))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (context + max(widths),), generator=gen).tolist()
    runner.forward([RowInput(ids[:context], 0, table, context - 1)])  # the context's KV
    out = {}
    for width in widths:
        row = RowInput(ids[context: context + width], context, table, 0)
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            _sync(device)
            start = time.perf_counter()
            runner.forward([row])
            _sync(device)
            times.append(time.perf_counter() - start)
        out[str(width)] = round(1e3 * sorted(times[1:])[len(times[1:]) // 2], 3)
    return out


def transformers_generate(cfg: ModelConfig, device: torch.device, batch: int, prompt_len: int,
                          new_tokens: int) -> dict:
    """Hugging Face `generate` (greedy, bf16, the same shapes, its own random weights)."""
    import transformers
    kind = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[cfg.family]
    hf_cfg = getattr(transformers, kind[0])(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=4096,
        **({"head_dim": cfg.head_dim} if cfg.family == "llama" else {}))
    with torch.device(device):
        model = getattr(transformers, kind[1])(hf_cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, **kwargs)
    _sync(device)
    return {"batch": batch, "tok_s": round(batch * new_tokens / (time.perf_counter() - start), 1)}


def benchmark(shapes: dict, device: torch.device, batches: list[int], widths: list[int], prompt_len: int,
              new_tokens: int, bandwidth: float, peer: bool) -> dict:
    out = {}
    for name, cfg in shapes.items():
        model = random_model(replace(cfg, max_position_embeddings=max(4096, 2 * prompt_len)), device)
        entry = {"weight_bytes": weight_bytes(model),
                 "decode": [decode_throughput(model, b, prompt_len, new_tokens, bandwidth) for b in batches],
                 "verify_ms_by_width": step_by_width(model, widths, prompt_len, repeats=5),
                 "cuda_graphs": "not built: eager only"}
        del model
        if peer:
            try:
                entry["transformers"] = [transformers_generate(cfg, device, b, prompt_len, new_tokens) for b in batches]
            except Exception as exc:  # the peer failing must not lose verispec's numbers
                entry["transformers"] = {"error": f"{type(exc).__name__}: {exc}"}
        out[name] = entry
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="gpu-check.json")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few tokens (checks the script itself)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--no-peer", action="store_true", help="skip transformers' generate")
    ap.add_argument("--test-timeout", type=int, default=300)
    args = ap.parse_args(argv)
    report = {"environment": environment(args.device)}
    write = lambda: Path(args.out).write_text(json.dumps(report, indent=2))  # noqa: E731
    if report["environment"]["missing"] and args.device.startswith("cuda"):
        write()
        print("missing:", "; ".join(report["environment"]["missing"]), file=sys.stderr)
        return 2
    if not args.skip_tests:
        report["tests"] = run_gpu_tests(args.device, args.test_timeout)
        write()
        print("tests:", report["tests"].get("summary") or report["tests"].get("error"), flush=True)
    device = resolve_device(args.device)
    report["copy_bandwidth_gb_s"] = round(copy_bandwidth(device, 64 if args.quick else 1024) / 1e9, 1)
    report["benchmark"] = benchmark(QUICK if args.quick else SHAPES, device, [1, 2] if args.quick else [1, 8, 32],
                                    [1, 2, 4] if args.quick else list(range(1, 17)), 32 if args.quick else 512,
                                    8 if args.quick else 128, report["copy_bandwidth_gb_s"] * 1e9,
                                    peer=not args.no_peer and "transformers" in report["environment"])
    write()
    print(json.dumps(report["benchmark"], indent=1))
    return 0 if report.get("tests", {"ok": True})["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
