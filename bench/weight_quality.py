"""Quality of a weight format against the float32 model: perplexity, KL, greedy agreement.

On real chat prompts (the spec-bench datasets, seeded), the float32 model writes a greedy
reference continuation; every format then scores prompt + reference in one teacher-forced
pass. Reported per format:

  ppl            perplexity of the reference continuation
  kl             mean KL(float32 || format) over the continuation's positions
  top1           fraction of positions whose argmax equals float32's
  greedy_same    fraction of prompts whose own greedy continuation (engine, plain decoding)
                 is token-identical to the dense bf16 model's; and the mean common prefix

    .venv/bin/python bench/weight_quality.py --prompts 20 --max-tokens 96

Writes bench/results/weight-quality-<model>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.roofline import chat_prompts, run_request  # noqa: E402
from verispec.bench.provenance import git_info, machine_info, software_versions  # noqa: E402
from verispec.config import CacheConfig, EngineConfig, SpecConfig  # noqa: E402
from verispec.engine.engine import LLMEngine, SpecOverride  # noqa: E402
from verispec.engine.runner import ModelRunner, RowInput  # noqa: E402
from verispec.model.llama import LlamaModel  # noqa: E402
from verispec.model.loader import load_model_files, resolve_model  # noqa: E402

FORMATS = {  # name -> (dtype, weight_format)
    "float32": (torch.float32, "dense"),
    "bf16": (torch.bfloat16, "dense"),
    "int8": (torch.bfloat16, "int8"),
    "int4": (torch.bfloat16, "int4"),
    "int4a8": (torch.bfloat16, "int4a8"),
}


def sequence_logits(model: LlamaModel, token_ids: list[int]) -> torch.Tensor:
    """(T, V) float32 logits of every position, one prefill pass."""
    blocks = -(-len(token_ids) // 16)
    runner = ModelRunner(model, blocks * 16, 16)
    return runner.forward([RowInput(list(token_ids), 0, list(range(blocks)), 0)])[0]


def score(model: LlamaModel, prompt: list[int], continuation: list[int], ref_logp: torch.Tensor | None):
    """Log-probabilities of the continuation, and the per-position distributions."""
    logits = sequence_logits(model, prompt + continuation)[len(prompt) - 1: -1]  # (n, V)
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(1, torch.tensor(continuation)[:, None]).squeeze(1)
    kl = None if ref_logp is None else (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    return logp, nll, kl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    source = resolve_model(args.model)
    cfg, state, tokenizer = load_model_files(source)
    gguf = source.path if source.kind == "gguf" else None
    names = args.formats.split(",")
    models = {n: LlamaModel.from_state_dict(cfg, state, dtype=FORMATS[n][0], weight_format=FORMATS[n][1],
                                            gguf_path=gguf) for n in names}
    prompts, _ = chat_prompts(tokenizer, args.prompts, args.seed)

    # Greedy continuations through the engine (plain decoding), one engine per format.
    outputs = {}
    for n, model in models.items():
        config = EngineConfig(model=args.model, dtype=str(FORMATS[n][0]).removeprefix("torch."),
                              weight_format=FORMATS[n][1], spec=SpecConfig(method="none"),
                              cache=CacheConfig(num_kv_tokens=4096))
        engine = LLMEngine(config, model, tokenizer)
        outputs[n] = [run_request(engine, p["token_ids"], args.max_tokens, SpecOverride(method="none"))
                      ["output_token_ids"] for p in prompts]

    reference = "float32" if "float32" in models else names[0]
    per_format = {n: {"nll": [], "kl": [], "top1": []} for n in names}
    for i, p in enumerate(prompts):
        cont = outputs[reference][i]
        ref_logp, ref_nll, _ = score(models[reference], p["token_ids"], cont, None)
        for n in names:
            logp, nll, kl = score(models[n], p["token_ids"], cont, ref_logp)
            per_format[n]["nll"].extend(nll.tolist())
            per_format[n]["kl"].extend(kl.tolist())
            per_format[n]["top1"].extend((logp.argmax(-1) == ref_logp.argmax(-1)).tolist())

    base = "bf16" if "bf16" in outputs else reference
    table = {}
    for n in names:
        same = [a == b for a, b in zip(outputs[n], outputs[base])]
        prefix = [_common_prefix(a, b) / max(len(b), 1) for a, b in zip(outputs[n], outputs[base])]
        f = per_format[n]
        table[n] = {"ppl": float(torch.tensor(f["nll"]).mean().exp()), "kl": statistics.mean(f["kl"]),
                    "top1": statistics.mean(f["top1"]), f"greedy_same_as_{base}": statistics.mean(same),
                    f"mean_common_prefix_vs_{base}": statistics.mean(prefix),
                    "resolved_weight_format": models[n].weight_format}
    result = {"script": "bench/weight_quality.py", "argv": sys.argv[1:], "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "model": args.model, "reference": reference, "num_prompts": len(prompts),
              "num_positions": len(per_format[names[0]]["nll"]), "prompts": [(p["dataset"], p["prompt_id"]) for p in prompts],
              "machine": machine_info(), "software": software_versions(), "git": git_info(), "formats": table}
    out = args.out or REPO / "bench" / "results" / f"weight-quality-{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"{args.model}: {len(prompts)} prompts, {result['num_positions']} scored positions "
          f"(reference continuation: {reference} greedy)")
    print(f"{'format':8s} {'ppl':>8s} {'KL':>9s} {'top1':>6s} {'same':>6s} {'prefix':>7s}")
    for n, row in table.items():
        print(f"{n:8s} {row['ppl']:8.3f} {row['kl']:9.5f} {row['top1']:6.3f} "
              f"{row[f'greedy_same_as_{base}']:6.2f} {row[f'mean_common_prefix_vs_{base}']:7.2f}")
    print(f"wrote {out}")
    return 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


if __name__ == "__main__":
    sys.exit(main())
