"""`verispec train-draft traces | filter | train | export | all | gate | eagle`.

Each stage reads the previous stage's folder under --work-dir (default
<VERISPEC_CACHE>/train/<target>/) and can be rerun at any time: finished work is skipped,
interrupted work resumes, and changed settings are refused rather than mixed in.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from verispec.model.fetch import cache_root
from verispec.model.registry import DEFAULT_MODEL
from verispec.train.config import FilterConfig, TracesConfig, TrainConfig

log = logging.getLogger("verispec")
STAGES = ("traces", "filter", "train", "export", "all", "gate", "eagle")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Subcommands of `verispec train-draft`."""
    sub = parser.add_subparsers(dest="stage", required=True)
    helps = {"traces": "run the target on training prompts; store outputs + top-k log-probs",
             "filter": "deduplicate, drop degenerate outputs, decontaminate against benchmarks",
             "train": "train the draft by top-k distillation (resumable)",
             "export": "write the draft as an HF directory where --spec draft finds it",
             "all": "traces, filter, train and export in turn",
             "gate": "acceptance and decode speed of draft vs n-gram vs plain, per task",
             "eagle": "an EAGLE-style head from the filtered traces: target features, training, "
                      "export (verispec/train/eagle.py)"}
    for stage in STAGES:
        p = sub.add_parser(stage, help=helps[stage])
        _add_common(p)
        if stage in ("traces", "all"):
            _add_traces(p)
        if stage in ("filter", "all"):
            _add_filter(p)
        if stage in ("train", "all"):
            _add_train(p)
        if stage in ("export", "all"):
            p.add_argument("--out", help="export directory (default: the registered draft folder)")
        if stage == "gate":
            _add_gate(p)
        if stage == "eagle":
            _add_eagle(p)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_MODEL, help=f"target model (default {DEFAULT_MODEL})")
    p.add_argument("--work-dir", help="stage folders (default <cache>/train/<target>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_traces(p: argparse.ArgumentParser) -> None:
    d = TracesConfig()
    g = p.add_argument_group("traces")
    g.add_argument("--num-prompts", type=int, default=d.num_prompts)
    g.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    g.add_argument("--max-tokens", type=int, default=d.max_tokens, help="generated tokens per prompt")
    g.add_argument("--temperature", type=float, default=d.temperature)
    g.add_argument("--top-k-logprobs", type=int, default=d.top_k_logprobs)
    g.add_argument("--shard-size", type=int, default=d.shard_size)
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="requests in flight")
    g.add_argument("--seed", type=int, default=d.seed)


def _add_filter(p: argparse.ArgumentParser) -> None:
    d = FilterConfig()
    g = p.add_argument_group("filter")
    g.add_argument("--ngram", type=int, default=d.ngram, help="decontamination word n-gram")
    g.add_argument("--heldout-fraction", type=float, default=d.heldout_fraction)


def _add_train(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    g = p.add_argument_group("train")
    g.add_argument("--layers", default=",".join(map(str, d.layers)),
                   help="target layers copied into the draft, e.g. 0,29")
    g.add_argument("--steps", type=int, default=d.steps)
    g.add_argument("--tokens-per-step", type=int, default=d.tokens_per_step)
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    g.add_argument("--ce-weight", type=float, default=d.ce_weight)
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    g.add_argument("--eval-every", type=int, default=d.eval_every)
    g.add_argument("--train-embeddings", action="store_true", help="also train the tied embedding / head")


def _add_gate(p: argparse.ArgumentParser) -> None:
    from verispec.train.gate import GateConfig
    d = GateConfig()
    p.add_argument("--draft-model", help="draft directory (default: the registered draft)")
    p.add_argument("--tasks", default=",".join(d.tasks), help="benchmark sets + 'chat-heldout'")
    p.add_argument("--prompts-per-task", type=int, default=d.prompts_per_task)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--max-load", type=float, default=d.max_load,
                   help="refuse to time while the 1-minute load average is above this")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="seconds to wait for the load average to fall below --max-load")
    p.add_argument("--fixed-k", type=int, help="fixed k instead of adaptive (acceptance at a known k)")
    p.add_argument("--out", help="JSON results file (default <work-dir>/gate.json)")


def _add_eagle(p: argparse.ArgumentParser) -> None:
    from verispec.train.eagle import EagleConfig
    d = EagleConfig()
    g = p.add_argument_group("eagle")
    g.add_argument("--draft-vocab", type=int, default=d.num_draft_vocab,
                   help="N: the head's vocabulary, the most frequent output tokens of the traces")
    g.add_argument("--steps", type=int, default=d.steps)
    g.add_argument("--tokens-per-step", type=int, default=d.tokens_per_step)
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--feature-weight", type=float, default=d.feature_weight)
    g.add_argument("--supervise-prompt", action="store_true", help="also train on prompt positions")
    g.add_argument("--own-feature-prob", type=float, default=d.own_feature_prob,
                   help="share of input features replaced by the head's own prediction (later drafts read those)")
    g.add_argument("--out", help="head folder (default: <cache>/heads/<target>, where --spec eagle finds it)")


def _work_dir(args) -> Path:
    return Path(args.work_dir).expanduser() if args.work_dir else cache_root() / "train" / args.target


def main(args: argparse.Namespace) -> int:
    """Run the chosen stage(s); returns the exit status."""
    work = _work_dir(args)
    if args.stage == "gate":
        from verispec.train.gate import run_gate_cli
        return run_gate_cli(args, work)
    if args.stage == "eagle":
        from verispec.train.eagle import run_eagle_cli
        return run_eagle_cli(args, work)
    stages = ("traces", "filter", "train", "export") if args.stage == "all" else (args.stage,)
    for stage in stages:
        {"traces": stage_traces, "filter": stage_filter, "train": stage_train,
         "export": stage_export}[stage](args, work)
    return 0


def traces_config(args) -> TracesConfig:
    return TracesConfig(target=args.target, num_prompts=args.num_prompts,
                        max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
                        temperature=args.temperature, top_k_logprobs=args.top_k_logprobs,
                        shard_size=args.shard_size, batch_size=args.batch_size, seed=args.seed)


def train_config(args) -> TrainConfig:
    try:
        layers = tuple(int(x) for x in args.layers.split(","))
    except ValueError:
        raise ValueError(f"--layers must be comma-separated integers, got {args.layers!r}") from None
    return TrainConfig(layers=layers, train_embeddings=args.train_embeddings, steps=args.steps,
                       tokens_per_step=args.tokens_per_step, lr=args.lr, warmup_steps=args.warmup_steps,
                       ce_weight=args.ce_weight, checkpoint_every=args.checkpoint_every,
                       eval_every=args.eval_every)


def stage_traces(args, work: Path) -> None:
    from verispec.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from verispec.engine.engine import LLMEngine
    from verispec.train.prompts import load_sharegpt, split_prompts
    from verispec.train.traces import run_traces

    cfg = traces_config(args)
    prompts, source = load_sharegpt()
    engine = LLMEngine.from_config(EngineConfig(
        model=cfg.target, dtype=cfg.dtype, seed=cfg.seed, spec=SpecConfig(method="none"),
        cache=CacheConfig(num_kv_tokens=cfg.batch_size * (cfg.max_prompt_tokens + cfg.max_tokens + 32)),
        scheduler=SchedulerConfig(max_num_seqs=cfg.batch_size, max_num_batched_tokens=1024)))
    summary = run_traces(cfg, work / "traces", split_prompts(prompts, cfg.seed), engine, source.to_dict(),
                         progress=not args.no_progress)
    print(f"traces: {summary.num_examples} examples, {summary.num_output_tokens} output tokens in "
          f"{summary.num_shards} shards ({summary.shards_run} generated now, {summary.seconds:.0f} s) "
          f"-> {work / 'traces'}")


def stage_filter(args, work: Path) -> None:
    from verispec.model.loader import load_config_and_tokenizer, resolve_model
    from verispec.train.filter import run_filter

    cfg = FilterConfig(ngram=getattr(args, "ngram", 13),
                       heldout_fraction=getattr(args, "heldout_fraction", FilterConfig().heldout_fraction))
    _, tokenizer = load_config_and_tokenizer(resolve_model(args.target))
    report, ran = run_filter(cfg, work / "traces", work / "filtered", tokenizer.eos_token_ids)
    print(("filter:" if ran else "filter (already done):") + "\n" + "\n".join(report.lines()))
    print(f"  report: {work / 'filtered' / 'report.json'}")


def _target_files(target: str):
    from verispec.model.loader import ensure_cached, load_model_files, resolve_model
    source = resolve_model(target)
    tcfg, tstate, tokenizer = load_model_files(source)
    # HF names only: the GGUF cache folder may also hold the engine's fused runtime-weights
    # file, which load_model_files (it reads every *.safetensors there) merges in.
    tstate = {k: v for k, v in tstate.items() if k.startswith("model.") or k == "lm_head.weight"}
    return tcfg, tstate, tokenizer, (ensure_cached(source) if source.kind == "gguf" else source.path)


def stage_train(args, work: Path) -> None:
    import torch

    from verispec.train.distill import run_train
    from verispec.train.draft import build_draft

    cfg = train_config(args)
    tcfg, tstate, _, _ = _target_files(args.target)
    torch.manual_seed(cfg.seed)
    model = build_draft(tcfg, tstate, cfg.layers, cfg.train_embeddings)
    done, ran = run_train(cfg, work / "filtered", work / "train", model, args.target,
                          progress=not args.no_progress)
    print(("train:" if ran else "train (already done):") + f" {done['steps']} steps; held-out "
          f"greedy agreement {_fmt(done['eval_first'])} -> {_fmt(done['eval_last'])}; "
          f"loss curve {work / 'train' / 'loss.png'}")


def _fmt(e: dict | None) -> str:
    return "n/a" if not e else f"{e['greedy_agree']:.3f} (overlap {e['overlap']:.3f})"


def stage_export(args, work: Path) -> None:
    from verispec.spec.compat import check_pair_cli
    from verispec.train.distill import load_trained
    from verispec.train.draft import build_draft
    from verispec.train.export import export_draft
    from verispec.train.registry import draft_dir
    from verispec.train.store import read_json

    settings = read_json(work / "train" / "settings.json")
    cfg = TrainConfig(**{**settings["config"], "layers": tuple(settings["config"]["layers"])})
    tcfg, tstate, _, target_dir = _target_files(args.target)
    model = load_trained(work / "train", build_draft(tcfg, tstate, cfg.layers, cfg.train_embeddings))
    out = Path(args.out).expanduser() if getattr(args, "out", None) else draft_dir(args.target)
    provenance = {"target": args.target, "train": settings, "done": read_json(work / "train" / "done.json"),
                  "filter_report": read_json(work / "filtered" / "report.json"),
                  "traces": read_json(work / "traces" / "settings.json")}
    export_draft(model, target_dir, out, provenance)
    ok, message = check_pair_cli(args.target, str(out))
    size_mb = (out / "model.safetensors").stat().st_size / 2**20
    print(f"export: {out} ({size_mb:.0f} MiB)\n  {message}")
    if not ok:
        raise ValueError(f"the exported draft does not pass check-pair: {message}")


if __name__ == "__main__":  # python -m verispec.train.cli <stage> ...
    import sys
    parser = argparse.ArgumentParser(prog="verispec train-draft", description=__doc__.splitlines()[0])
    add_arguments(parser)
    logging.basicConfig(level=logging.WARNING, format="verispec: %(message)s")
    sys.exit(main(parser.parse_args()))
