"""One configuration object per run: frozen dataclasses built from flags or a YAML file.

`EngineConfig` composes the parts; `to_dict()` is what every benchmark result records
next to its numbers. Nothing writes back into a config; derived values are properties.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import yaml

from verispec.spec.proposer import proposer_names

DTYPES = ("bfloat16", "float32")
# verispec.model.quant.WEIGHT_FORMATS (repeated here: config must not import torch)
WEIGHT_FORMATS = ("auto", "dense", "int8", "int4", "int4a8")
KERNELS = ("auto", "on", "off")


def spec_methods() -> tuple[str, ...]:
    """Speculation methods: "none" and every registered proposer (spec/proposer.py)."""
    return ("none", *proposer_names())


@dataclass(frozen=True)
class SpecConfig:
    """Speculation defaults; a request may override method, k and adaptivity."""

    method: str = "ngram"            # "none" | "ngram" | "draft"
    num_spec_tokens: int = 4         # k_max when adaptive, k when fixed
    adaptive: bool = True
    ngram_max: int = 4
    ngram_min: int = 1

    def __post_init__(self):
        if self.method not in spec_methods():
            raise ValueError(f"spec method must be one of {spec_methods()}, got {self.method!r}")
        if not 1 <= self.num_spec_tokens <= 16:
            raise ValueError(f"num_spec_tokens must be in [1, 16], got {self.num_spec_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_tokens: int = 32768       # pool capacity in tokens (rounded up to whole blocks)
    prefix_cache: bool = True

    def __post_init__(self):
        if self.block_size < 1 or self.num_kv_tokens < self.block_size:
            raise ValueError(f"need block_size >= 1 and num_kv_tokens >= block_size, got "
                             f"{self.block_size}, {self.num_kv_tokens}")

    @property
    def num_blocks(self) -> int:
        return -(-self.num_kv_tokens // self.block_size)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32           # running requests at once
    max_num_batched_tokens: int = 512  # tokens per step: prefill chunks + verify rows (1 + chosen k each)
    max_model_len: int | None = None  # None: the model's context length

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and a generated one), "
                             f"got {self.max_model_len}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    draft_model: str | None = None   # None with spec method "draft": the model's registered draft
    dtype: str = "bfloat16"
    weight_format: str = "auto"      # "auto" (int4 for a Q4 GGUF, else dense) | "dense" | "int8" | "int4" | "int4a8"
    draft_weight_format: str = "auto"  # the draft model's; "auto" = int4 for a Q4 GGUF, else int8 (bf16)
    threads: int | None = None       # torch intra-op threads; None = auto_threads() for the mode
    kernels: str = "auto"            # fused C++ CPU kernels (model/kernels.py): "auto" (if they build) | "on" | "off"
    huge_pages: bool = True          # CPU weights in huge pages where the OS offers them (model/memory.py)
    seed: int = 0
    spec: SpecConfig = field(default_factory=SpecConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if not isinstance(self.huge_pages, bool):
            raise ValueError(f"huge_pages must be true or false, got {self.huge_pages!r}")
        for name in ("weight_format", "draft_weight_format"):
            value = getattr(self, name)
            if value not in WEIGHT_FORMATS:
                raise ValueError(f"{name} must be one of {WEIGHT_FORMATS}, got {value!r}")
            if value not in ("auto", "dense") and self.dtype != "bfloat16":
                raise ValueError(f"{name} {value!r} needs dtype bfloat16, got {self.dtype!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        d = dict(d)
        parts = {"spec": SpecConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
        for key, klass in parts.items():
            if key in d:
                d[key] = _build(klass, d[key], key)
        return _build(cls, d, "config")

    @classmethod
    def from_yaml(cls, path: str) -> "EngineConfig":
        with open(path) as f:
            return cls.from_dict(yaml.safe_load(f) or {})

    def with_overrides(self, **kw) -> "EngineConfig":
        return replace(self, **kw)

    def resolved_for(self, mode: str) -> "EngineConfig":
        """This config with `threads` chosen for `mode` ("serve" or "generate") if unset."""
        return self if self.threads is not None else replace(self, threads=auto_threads(mode))


# Above this many cores `serve` leaves one to the HTTP front end (auto_threads).
SERVE_SPARE_CORE_ABOVE = 8


def auto_threads(mode: str) -> int:
    """Intra-op threads when none are set: one per physical core this process may run on.

    `serve` keeps them all on small machines: its front end is a separate process that
    used 3-5% of one core at 1 and 16 streams on two cores, where leaving it a whole core
    cost the engine 38% (1 thread: 103 tok/s, 2: 166). Above SERVE_SPARE_CORE_ABOVE cores
    a core is at most 1/9 of the compute, and a front-end wake-up that pre-empts one thread
    of a wide OpenMP team stalls every thread at the next barrier, so it gets its own.
    """
    if mode not in ("serve", "generate"):
        raise ValueError(f"mode must be 'serve' or 'generate', got {mode!r}")
    cores = physical_cores()
    return cores - 1 if mode == "serve" and cores > SERVE_SPARE_CORE_ABOVE else cores


def physical_cores() -> int:
    """Cores in this process's CPU affinity, hyperthread siblings counted once."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def _build(klass, values: dict, where: str):
    known = {f.name for f in fields(klass)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {where} option(s) {unknown}; known: {sorted(known)}")
    return klass(**values)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by generate / serve / bench; they override the YAML file if given."""
    g = parser.add_argument_group("engine")
    g.add_argument("--config", help="YAML file with an EngineConfig (flags override it)")
    g.add_argument("--model", help="registry name, .gguf file or Hugging Face directory "
                                   "(default smollm2-135m-instruct)")
    g.add_argument("--draft-model", help="draft model for --spec draft")
    g.add_argument("--dtype", choices=DTYPES)
    g.add_argument("--weight-format", choices=WEIGHT_FORMATS,
                   help="linear-layer weights: auto (default: int4 for a Q4_0/Q4_1 GGUF in bfloat16, "
                        "else dense), dense (in --dtype), int8 / int4 weight-only, or int4a8 (int4 with "
                        "8-bit activations, llama.cpp's arithmetic: faster, a measured quality change; "
                        "verispec's kernels only)")
    g.add_argument("--draft-weight-format", choices=WEIGHT_FORMATS,
                   help="the draft model's weights: auto (default, in bfloat16: int4 for a Q4_0/Q4_1 GGUF, "
                        "else int8; a draft's precision moves acceptance, never the output), dense, "
                        "int8 or int4")
    g.add_argument("--kernels", choices=KERNELS,
                   help="fused C++ CPU kernels for the decode step: auto (default: used when they "
                        "compile), on (an error if they do not), off (PyTorch ops only)")
    g.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=None,
                   help="copy the CPU weights into memory backed by 2 MiB pages where Linux offers "
                        "transparent huge pages (default on: fewer TLB misses while a step streams them)")
    g.add_argument("--spec", choices=spec_methods(), help="speculation method (default ngram)")
    g.add_argument("--num-spec-tokens", type=int, help="k (k_max when adaptive)")
    g.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="choose k per step from measured acceptance and cost (default on)")
    g.add_argument("--kv-tokens", type=int, help="KV pool capacity in tokens")
    g.add_argument("--block-size", type=int)
    g.add_argument("--no-prefix-cache", action="store_true", default=None)
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--threads", type=int, help="torch intra-op threads (default: one per physical "
                   "core; serve leaves one to its HTTP front end above 8 cores); on a machine shared "
                   "with other busy processes, fewer threads avoid stalls")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Resolve YAML (if any) + flags into one frozen EngineConfig."""
    base = EngineConfig.from_yaml(args.config) if getattr(args, "config", None) else EngineConfig()
    spec, cache, sched = asdict(base.spec), asdict(base.cache), asdict(base.scheduler)
    top = {k: v for k, v in asdict(base).items() if k not in ("spec", "cache", "scheduler")}
    _set(top, "model", args.model)
    _set(top, "draft_model", args.draft_model)
    _set(top, "dtype", args.dtype)
    _set(top, "weight_format", getattr(args, "weight_format", None))
    _set(top, "draft_weight_format", getattr(args, "draft_weight_format", None))
    _set(top, "seed", args.seed)
    _set(top, "threads", getattr(args, "threads", None))
    _set(top, "kernels", getattr(args, "kernels", None))
    _set(top, "huge_pages", getattr(args, "huge_pages", None))
    _set(spec, "method", args.spec)
    if args.spec is None and args.draft_model and not getattr(args, "config", None):
        spec["method"] = "draft"   # naming a draft model means you want to use it
    _set(spec, "num_spec_tokens", args.num_spec_tokens)
    _set(spec, "adaptive", args.spec_adaptive)
    _set(cache, "num_kv_tokens", args.kv_tokens)
    _set(cache, "block_size", args.block_size)
    if args.no_prefix_cache:
        cache["prefix_cache"] = False
    _set(sched, "max_num_seqs", args.max_num_seqs)
    _set(sched, "max_model_len", args.max_model_len)
    return EngineConfig.from_dict({**top, "spec": spec, "cache": cache, "scheduler": sched})


def _set(d: dict, key: str, value) -> None:
    if value is not None:
        d[key] = value
