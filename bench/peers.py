"""verispec next to the engines people would pick instead, on the same model, prompts, threads.

Contenders, run ALTERNATELY per prompt (the order rotates) so machine noise hits all alike:

  verispec         plain decoding, and n-gram speculation with adaptive k (weight format
                   --weight-format, default auto: int4 from the GGUF's Q4 blocks); and plain
                   decoding with dense bf16 weights (verispec.dense), transformers' dtype
  transformers     `generate` on the same GGUF (dequantized, --hf-dtype), plain and with
                   `prompt_lookup_num_tokens`
  llama.cpp        (only with --llama-server PATH) llama-server on the same GGUF: plain, and
                   each `--spec-type` n-gram mode with llama.cpp's defaults; n-gram modes keep
                   state across requests and an idle server's threads poll for work, so every
                   request gets a fresh server, warmed by one 1-token request of 8 arbitrary
                   token ids (its tokens/s are the server's own timings)

Every request is greedy, batch 1, the same chat-templated token ids, the same max tokens,
the same number of threads. Reported per contender: median decode tokens/s (tokens after
the first / time after the first), its ratio to verispec plain, and how many greedy outputs
equal the same engine's plain output (and verispec plain's).

    .venv/bin/python bench/peers.py --threads 2 --prompts 10 --max-tokens 128 \\
        [--llama-server /tmp/llamacpp-build/bin/llama-server]

llama.cpp is never a verispec dependency: build it apart (docs/benchmarks.md, Performance).
Writes bench/results/peers-<model>-t<threads>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.roofline import chat_prompts, load_average, run_request, wait_for_quiet  # noqa: E402
from verispec.bench.provenance import git_info, machine_info, software_versions  # noqa: E402
from verispec.config import CacheConfig, EngineConfig, SpecConfig  # noqa: E402
from verispec.engine.engine import LLMEngine, SpecOverride  # noqa: E402
from verispec.model.loader import resolve_model  # noqa: E402

LLAMA_NGRAM_MODES = ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")
WARMUP_IDS = [1, 2, 3, 4, 5, 6, 7, 8]  # one token from 8 arbitrary ids warms a fresh llama-server


# --- verispec ------------------------------------------------------------------------------------

class Verispec:
    def __init__(self, model: str, weight_format: str):
        self.config = EngineConfig(model=model, weight_format=weight_format,
                                   spec=SpecConfig(method="ngram", adaptive=True),
                                   cache=CacheConfig(num_kv_tokens=8192, prefix_cache=False))
        self.engine = LLMEngine.from_config(self.config)

    def run(self, token_ids: list[int], max_tokens: int, spec: bool) -> dict:
        r = run_request(self.engine, token_ids, max_tokens,
                        SpecOverride(method="ngram", adaptive=True) if spec else SpecOverride(method="none"))
        return {k: r[k] for k in ("ttft_s", "decode_tokens_per_s", "output_token_ids", "acceptance_rate")}


# --- transformers --------------------------------------------------------------------------------

class _Clock:
    """A generate() streamer that only timestamps: the prompt, then each batch of new tokens."""

    def __init__(self):
        self.times, self.counts = [], []

    def put(self, value):
        self.times.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self):
        pass


class Transformers:
    def __init__(self, gguf: Path, dtype: str, eos_ids: list[int]):
        import transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype)).eval()
        self.eos = list(eos_ids)

    def run(self, token_ids: list[int], max_tokens: int, lookup: int | None) -> dict:
        clock = _Clock()
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([token_ids]), do_sample=False, max_new_tokens=max_tokens,
                                      eos_token_id=self.eos, pad_token_id=self.eos[0], streamer=clock, **extra)
        end = time.perf_counter()
        new = out[0, len(token_ids):].tolist()
        first = clock.times[1] if len(clock.times) > 1 else end  # times[0]: the prompt itself
        n = len(new)
        return {"ttft_s": first - t0, "output_token_ids": new,
                "decode_tokens_per_s": (n - 1) / (end - first) if n > 1 and end > first else None}


# --- llama.cpp -----------------------------------------------------------------------------------

class LlamaServer:
    """llama-server on a free port; `mode` None = plain, else a --spec-type n-gram mode."""

    def __init__(self, binary: Path, gguf: Path, threads: int, mode: str | None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [str(binary), "-m", str(gguf), "--port", str(self.port), "--host", "127.0.0.1",
               "-t", str(threads), "-tb", str(threads), "-c", "4096", "-np", "1", "--no-webui"]
        if mode:  # each mode with llama.cpp's own defaults (draft sizes, n-gram lengths)
            cmd += ["--spec-type", mode]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server did not come up: {' '.join(cmd)}")

    def run(self, token_ids: list[int], max_tokens: int) -> dict:
        body = {"prompt": token_ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        t = out.get("timings", {})
        return {"ttft_s": t.get("prompt_ms", 0) / 1000, "output_token_ids": out.get("tokens", []),
                "decode_tokens_per_s": t.get("predicted_per_second"), "wall_s": time.perf_counter() - t0,
                "draft_n": t.get("draft_n"), "draft_n_accepted": t.get("draft_n_accepted")}

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --- the comparison ------------------------------------------------------------------------------

def build_contenders(args, gguf: Path, verispec: Verispec) -> dict:
    """name -> callable(token_ids) -> record; the engines are loaded once."""
    mt = args.max_tokens
    out = {"verispec-plain": lambda ids: verispec.run(ids, mt, spec=False),
           "verispec-ngram-adaptive": lambda ids: verispec.run(ids, mt, spec=True)}
    if args.dense_too and verispec.engine.target.model.weight_format != "dense":
        dense = Verispec(args.model, "dense")  # bf16 weights: the same dtype as transformers'
        out["verispec.dense-plain"] = lambda ids: dense.run(ids, mt, spec=False)
    if not args.no_transformers:
        hf = Transformers(gguf, args.hf_dtype, list(verispec.engine.eos_ids))
        out["transformers-plain"] = lambda ids: hf.run(ids, mt, None)
        out[f"transformers-lookup{args.hf_lookup}"] = lambda ids: hf.run(ids, mt, args.hf_lookup)
    if args.llama_server:
        # A fresh server for every request: n-gram modes keep state across requests, and an
        # idle llama-server's threads poll for work, which would slow the other contenders.
        for mode in [None] + args.llama_modes.split(","):
            def fresh(ids, mode=mode):
                server = LlamaServer(args.llama_server, gguf, args.threads, mode)
                try:
                    server.run(WARMUP_IDS, 1)  # a fresh process's first decode is cold
                    return server.run(ids, mt)
                finally:
                    server.close()
            out[f"llama.cpp-{mode or 'plain'}"] = fresh
    return out


def summarize(records: dict[str, list[dict]]) -> dict:
    base = statistics.median(r["decode_tokens_per_s"] for r in records["verispec-plain"])
    plain_of = {"verispec": "verispec-plain", "verispec.dense": "verispec.dense-plain",
                "transformers": "transformers-plain", "llama.cpp": "llama.cpp-plain"}
    table = {}
    for name, rs in records.items():
        tps = statistics.median(r["decode_tokens_per_s"] for r in rs if r["decode_tokens_per_s"])
        own = records.get(plain_of[name.split("-")[0]])
        same_own = sum(a["output_token_ids"] == b["output_token_ids"] for a, b in zip(rs, own)) if own else None
        same_vs = sum(a["output_token_ids"] == b["output_token_ids"] for a, b in zip(rs, records["verispec-plain"]))
        table[name] = {"median_decode_tokens_per_s": tps, "vs_verispec_plain": tps / base,
                       "greedy_same_as_own_plain": same_own, "greedy_same_as_verispec_plain": same_vs,
                       "num_requests": len(rs)}
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weight-format", default="auto", choices=["auto", "dense", "int8", "int4", "int4a8"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--hf-lookup", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--dense-too", action=argparse.BooleanOptionalAction, default=True,
                    help="also run verispec with dense bf16 weights (plain), transformers' dtype")
    ap.add_argument("--llama-server", type=Path, default=None, help="llama-server binary (built apart)")
    ap.add_argument("--llama-modes", default=",".join(LLAMA_NGRAM_MODES))
    ap.add_argument("--max-load", type=float, default=1.3)
    ap.add_argument("--wait-s", type=float, default=600)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    source = resolve_model(args.model)
    if source.kind != "gguf":
        raise SystemExit("peers.py compares engines on one GGUF file; give a registry name or a .gguf")
    verispec = Verispec(args.model, args.weight_format)
    contenders = build_contenders(args, source.path, verispec)
    prompts, warm = chat_prompts(verispec.engine.tokenizer, args.prompts, args.seed)
    for w in warm[:1]:
        for fn in contenders.values():
            fn(w["token_ids"][:64])

    waited = wait_for_quiet(args.max_load, args.wait_s)
    load_before = load_average()
    names = list(contenders)
    records = {n: [] for n in names}
    for i, p in enumerate(prompts):
        order = names[i % len(names):] + names[: i % len(names)]
        for n in order:
            r = contenders[n](p["token_ids"])
            records[n].append({"dataset": p["dataset"], "prompt_id": p["prompt_id"],
                               "num_prompt_tokens": len(p["token_ids"]), **r})
        print(f"prompt {i + 1}/{len(prompts)} done (load {load_average():.2f})", flush=True)
    table = summarize(records)
    result = {"script": "bench/peers.py", "argv": sys.argv[1:], "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "model": args.model, "gguf": str(source.path), "threads": args.threads,
              "verispec_config": verispec.config.to_dict(),
              "verispec_resolved_weight_format": verispec.engine.target.model.weight_format,
              "transformers_dtype": None if args.no_transformers else args.hf_dtype,
              "llama_server": str(args.llama_server) if args.llama_server else None,
              "machine": machine_info(), "software": software_versions(), "git": git_info(),
              "load_average": {"before": load_before, "after": load_average(), "waited_s": waited},
              "table": table, "records": records}
    out = args.out or REPO / "bench" / "results" / f"peers-{args.model}-t{args.threads}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"{args.model}, {len(prompts)} prompts, {args.max_tokens} max tokens, greedy, {args.threads} threads, "
          f"verispec weights {result['verispec_resolved_weight_format']}, load {load_before:.2f} -> "
          f"{result['load_average']['after']:.2f}")
    print(f"{'contender':30s} {'tok/s':>8s} {'x vs verispec plain':>20s} {'same as own plain':>18s}")
    for n, row in table.items():
        same = "-" if row["greedy_same_as_own_plain"] is None else f"{row['greedy_same_as_own_plain']}/{row['num_requests']}"
        print(f"{n:30s} {row['median_decode_tokens_per_s']:8.1f} {row['vs_verispec_plain']:20.2f} {same:>18s}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
