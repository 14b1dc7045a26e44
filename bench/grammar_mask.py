"""Token-mask time per token of the grammar engines verispec could use, on CPU.

Structured output masks every scored position (a verify row's k + 1 of them), so the
engine is chosen by this number: the time to compute one allowed-token bitmask while
walking a valid JSON answer token by token, for a JSON schema and for free JSON
(`json_object`), on a model's vocabulary (default: the default model's 49k tokens).

    .venv/bin/python bench/grammar_mask.py --out bench/results/grammar-mask-<machine>.json

xgrammar is measured only where it is installed (`pip install --no-deps xgrammar
apache-tvm-ffi`; it is not a verispec dependency).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "tags", "address"],
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
          "tags": ["mathematics", "poetry", "engines"],
          "address": {"city": "London", "zip": "W1"}}


def _walk(mask_fn, consume_fn, tokens: list[int]) -> list[float]:
    """Seconds for each position's mask along `tokens` (consuming each after its mask)."""
    times = []
    for t in tokens:
        start = time.perf_counter()
        mask_fn()
        times.append(time.perf_counter() - start)
        consume_fn(t)
    return times


def measure_llguidance(tokenizer_json: str, eos: list[int], tokens: list[int]) -> dict:
    import llguidance
    import llguidance.torch as llt

    start = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
    setup = time.perf_counter() - start
    out = {"tokenizer_setup_s": setup}
    for name, grammar in (("json_schema", llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)),
                          ("json_object", llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}))):
        start = time.perf_counter()
        m = llguidance.LLMatcher(tok, grammar)
        compile_s = time.perf_counter() - start
        mask = llt.allocate_token_bitmask(1, tok.vocab_size)
        times = _walk(lambda: llt.fill_next_token_bitmask(m, mask), m.consume_token, tokens)
        assert not m.is_error(), m.get_error()
        out[name] = _summary(times, compile_s)
    return out


def measure_xgrammar(model_dir: Path, tokens: list[int]) -> dict | None:
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    start = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf)
    compiler = xgr.GrammarCompiler(info)
    out = {"tokenizer_setup_s": time.perf_counter() - start}
    for name, make in (("json_schema", lambda: compiler.compile_json_schema(json.dumps(SCHEMA))),
                       ("json_object", compiler.compile_builtin_json_grammar)):
        start = time.perf_counter()
        compiled = make()
        compile_s = time.perf_counter() - start
        m = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        times = _walk(lambda: m.fill_next_token_bitmask(mask), m.accept_token, tokens)
        out[name] = _summary(times, compile_s)
    return out


def _summary(times: list[float], compile_s: float) -> dict:
    us = sorted(t * 1e6 for t in times)
    return {"compile_ms": compile_s * 1e3, "tokens": len(us), "mask_us_median": statistics.median(us),
            "mask_us_p90": us[int(0.9 * (len(us) - 1))], "mask_us_max": us[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model the registry resolves")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    from verispec.model.loader import ensure_cached, resolve_model
    source = resolve_model(args.model)
    model_dir = ensure_cached(source) if source.kind == "gguf" else source.path
    backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokens = backend.encode(json.dumps(ANSWER, indent=1), add_special_tokens=False).ids
    meta = json.loads((model_dir / "generation_config.json").read_text())
    eos = meta["eos_token_id"] if isinstance(meta["eos_token_id"], list) else [meta["eos_token_id"]]
    result = {"model": args.model, "vocab": backend.get_vocab_size(), "answer_tokens": len(tokens),
              "llguidance": measure_llguidance((model_dir / "tokenizer.json").read_text(), eos, tokens),
              "xgrammar": measure_xgrammar(model_dir, tokens)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
