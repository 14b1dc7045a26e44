"""verispec generate | serve | bench | check-pair | models | train-draft.

Bad input ends with a one-line error naming the problem and a non-zero exit, never a
traceback (set VERISPEC_DEBUG=1 to see one).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from verispec.config import add_engine_arguments, config_from_args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The server and bench flags pull in FastAPI / matplotlib: only import them when asked
    # for (or for --help), so `verispec generate` starts fast.
    wanted = argv[0] if argv else "--help"
    parser = argparse.ArgumentParser(prog="verispec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, streaming to stdout")
    gen.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model (same as --model)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    if wanted in ("serve", "-h", "--help"):
        srv.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model (same as --model)")
        add_engine_arguments(srv)
        from verispec.server.app import add_arguments as add_server_arguments
        add_server_arguments(srv)
        from verispec.ray import add_arguments as add_replica_arguments
        add_replica_arguments(srv)
    srv.set_defaults(func=cmd_serve)

    pair = sub.add_parser("check-pair", help="can DRAFT draft for TARGET? (compares tokenizers)")
    pair.add_argument("--target", required=True)
    pair.add_argument("--draft", required=True)
    pair.set_defaults(func=cmd_check_pair)

    models = sub.add_parser("models", help="list or fetch named models")
    models.add_argument("action", choices=["list", "fetch"])
    models.add_argument("name", nargs="?")
    models.set_defaults(func=cmd_models)

    bench = sub.add_parser("bench", help="evidence-grade benchmark against an OpenAI-compatible endpoint")
    if wanted in ("bench", "-h", "--help"):
        from verispec.bench.cli import add_arguments as add_bench_arguments
        add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    train = sub.add_parser("train-draft", help="distil a draft model from the target's own outputs")
    if wanted in ("train-draft", "-h", "--help"):
        from verispec.train.cli import add_arguments as add_train_arguments
        add_train_arguments(train)
    train.set_defaults(func=cmd_train_draft)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.command in ("models", "serve") else logging.WARNING,
                        format="verispec: %(message)s")
    try:
        _positional_model(args)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if os.environ.get("VERISPEC_DEBUG"):
            raise
        message, code = _describe_error(exc)
        print(f"verispec: {message}", file=sys.stderr)
        return code


def _positional_model(args) -> None:
    """`verispec serve MODEL` as vLLM spells it: the same as --model; both, differing, is an error."""
    model_tag = getattr(args, "model_tag", None)
    if model_tag is None:
        return
    if args.model is not None and args.model != model_tag:
        raise ValueError(f"the model is given twice and differs: {model_tag!r} and --model {args.model!r}")
    args.model = model_tag


def _describe_error(exc: Exception) -> tuple[str, int]:
    """One line for stderr and the exit code: 2 for bad input, 1 for anything unexpected."""
    import struct

    import yaml

    text = " ".join(str(exc).split())  # YAML and other errors span several lines
    if isinstance(exc, struct.error):  # a header field runs past the end of the file
        return f"error: model file is truncated or corrupt ({text})", 2
    if isinstance(exc, yaml.YAMLError):
        return f"error: config file is not valid YAML ({text})", 2
    if isinstance(exc, (ValueError, OSError)):  # OSError covers FileNotFoundError
        return f"error: {text}", 2
    return (f"internal error: {type(exc).__name__}: {text} "
            "(set VERISPEC_DEBUG=1 to see the traceback)"), 1


def cmd_generate(args) -> int:
    from verispec.sampling import SamplingParams
    # Validate the cheap things before loading any weights.
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed)
    config = config_from_args(args).resolved_for("generate")
    from verispec.engine.engine import LLMEngine
    t_launch = time.perf_counter()
    engine = LLMEngine.from_config(config)
    tok = engine.tokenizer
    prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    engine.add_request("cli", prompt_ids, params)
    t_start = time.perf_counter()
    t_first = None
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and t_first is None:
                t_first = time.perf_counter()
            if not args.json and out.new_text:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                final = out
    t_end = time.perf_counter()
    if final.error:
        raise ValueError(final.error)
    decode_s = t_end - (t_first or t_end)
    n = len(final.token_ids)
    if args.json:
        result = {
            "text": final.text, "token_ids": final.token_ids, "prompt_tokens": len(prompt_ids),
            "completion_tokens": n, "finish_reason": final.finish_reason,
            "ttft_s": round((t_first or t_end) - t_start, 4),
            "decode_tokens_per_s": round((n - 1) / decode_s, 2) if n > 1 and decode_s > 0 else None,
            "load_s": round(t_start - t_launch, 3),
            "spec": {"method": engine.spec_method, **final.spec.to_dict()},
            "config": engine.config.to_dict(),  # as run: "auto" weight formats resolved
        }
        print(json.dumps(result))
    else:
        sys.stdout.write("\n")
        s = final.spec
        summary = f"[{n} tokens, {final.finish_reason}, {(n - 1) / decode_s if n > 1 and decode_s else 0:.1f} tok/s"
        if s.num_drafts:
            summary += (f", {engine.spec_method}: accepted {s.num_accepted_tokens}/{s.num_draft_tokens} "
                        f"drafted ({s.acceptance_rate:.0%}), {n / max(s.target_forwards, 1):.2f} tokens/forward")
        print(summary + "]", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    import functools

    from verispec.engine.core import build_engine
    from verispec.server.app import serve
    if args.replicas is not None:  # threads are shared out per replica there, not resolved here
        return _serve_replicas(config_from_args(args), args)
    config = config_from_args(args).resolved_for("serve")
    from verispec.distributed.torchrun import run_worker, torchrun_rank
    me = torchrun_rank()
    if me is not None and me.rank > 0:   # rank 0 serves HTTP; the others run its forwards
        return run_worker(config, me)
    return serve(functools.partial(build_engine, config), args)


def _serve_replicas(config, args) -> int:
    try:
        from verispec.ray.app import serve_replicas
    except ImportError as exc:
        if (exc.name or "").split(".")[0] != "ray":
            raise
        raise ValueError("--replicas needs Ray Serve: pip install 'verispec[ray]'") from None
    return serve_replicas(config, args)


def cmd_check_pair(args) -> int:
    from verispec.spec.compat import check_pair_cli
    ok, message = check_pair_cli(args.target, args.draft)
    print(message)
    return 0 if ok else 1


def cmd_models(args) -> int:
    if args.action == "list":
        from verispec.model.registry import list_models
        for line in list_models():
            print(line)
        return 0
    if not args.name:
        raise ValueError("models fetch needs a name, e.g. qwen2.5-coder-pair")
    from verispec.model.fetch import fetch_pair
    fetch_pair(args.name)
    return 0


def cmd_train_draft(args) -> int:
    from verispec.train.cli import main as train_main
    return train_main(args)


def cmd_bench(args) -> int:
    from verispec.bench.cli import main as bench_main
    return bench_main(args)


if __name__ == "__main__":
    sys.exit(main())
