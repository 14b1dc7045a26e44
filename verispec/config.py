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

from verispec.spec.proposer import AUTO, NOT_AUTO_CANDIDATES, default_spec_tokens, proposer_names

DTYPES = ("bfloat16", "float32")
# verispec.model.quant.WEIGHT_FORMATS (repeated here: config must not import torch)
WEIGHT_FORMATS = ("auto", "dense", "int8", "int4", "int4a8")
KERNELS = ("auto", "on", "off")
DEVICES = ("cpu", "cuda")
# Where the sampling defaults of a request (server) or a generate call (LLM) that sets none
# come from: the model's generation_config.json ("auto", vLLM's default) or neutral values.
GENERATION_CONFIGS = ("auto", "vllm")


def spec_methods() -> tuple[str, ...]:
    """Speculation methods: "none", "auto" (a proposer per row and round, from
    `SpecConfig.auto_candidates`) and every registered proposer (spec/proposer.py)."""
    return ("none", AUTO, *proposer_names())


@dataclass(frozen=True)
class SpecConfig:
    """Speculation defaults; a request may override method, k and adaptivity."""

    # "none" | "auto" | "ngram" | "draft" | "suffix" | "eagle". "auto" (the lookup, or the
    # model's head where one is registered, per row and round) beat n-gram alone on the pair
    # with a head beyond the A/A's spread; without a head it is n-gram (docs/benchmarks.md)
    method: str = "auto"
    # k_max when adaptive, k when fixed (there 1-2 is usually best: set it with adaptive off);
    # None: each method's own (`spec_tokens`)
    num_spec_tokens: int | None = None
    adaptive: bool = True
    ngram_max: int = 4
    ngram_min: int = 1
    # What "auto" picks from (those the engine could build): the per-request lookups and a
    # head. Suffix decoding is left out by default: its global trie shares earlier requests'
    # outputs, which suits one trust domain only (README).
    auto_candidates: tuple[str, ...] = ("ngram", "eagle")
    # Finished outputs suffix decoding's global trie keeps (the oldest leave first; its node
    # budget still applies). None: as many as that budget holds; 0: none, so no request
    # drafts from another's output (vLLM's suffix_decoding_max_cached_requests)
    suffix_max_cached_requests: int | None = None
    # Suffix decoding's draft: at most ceil(factor x the matched length) tokens (a short match
    # predicts little), while the path's probability under the trie's counts stays at least
    # min_token_prob (vLLM's suffix_decoding_max_spec_factor and _min_token_prob)
    suffix_max_spec_factor: float = 2.0
    suffix_min_token_prob: float = 0.1

    def __post_init__(self):
        if self.method not in spec_methods():
            raise ValueError(f"spec method must be one of {spec_methods()}, got {self.method!r}")
        object.__setattr__(self, "auto_candidates", tuple(self.auto_candidates))
        allowed = [m for m in proposer_names() if m not in NOT_AUTO_CANDIDATES]
        bad = [m for m in self.auto_candidates if m not in allowed]
        if bad or not self.auto_candidates:
            raise ValueError(f"auto_candidates must be a non-empty list from {allowed}, got "
                             f"{list(self.auto_candidates)}")
        if self.num_spec_tokens is not None and not 1 <= self.num_spec_tokens <= 16:
            raise ValueError(f"num_spec_tokens must be in [1, 16], got {self.num_spec_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        cached = self.suffix_max_cached_requests
        if cached is not None and (not isinstance(cached, int) or isinstance(cached, bool) or cached < 0):
            raise ValueError(f"suffix_max_cached_requests must be an integer >= 0 (0: nothing shared "
                             f"between requests) or null (the trie's node budget alone), got {cached!r}")
        factor, prob = self.suffix_max_spec_factor, self.suffix_min_token_prob
        if not _is_number(factor) or factor <= 0:
            raise ValueError(f"suffix_max_spec_factor must be a number > 0 (tokens drafted per matched "
                             f"token), got {factor!r}")
        if not _is_number(prob) or not 0 <= prob <= 1:
            raise ValueError(f"suffix_min_token_prob must be a number in [0, 1], got {prob!r}")

    def spec_tokens(self, method: str) -> int:
        """k_max (k when not adaptive) of a request speculating with `method` that sets none."""
        return self.num_spec_tokens if self.num_spec_tokens is not None else default_spec_tokens(method)


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
    draft_head: str | None = None    # EAGLE-style head folder (spec method "eagle"); None: the model's registered head
    dtype: str = "bfloat16"
    weight_format: str = "auto"      # "auto" (int4 for a Q4 GGUF, else dense) | "dense" | "int8" | "int4" | "int4a8"
    draft_weight_format: str = "auto"  # the draft model's; "auto" = int4 for a Q4 GGUF, else int8 (bf16)
    threads: int | None = None       # torch intra-op threads; None = auto_threads() for the mode
    # C++ code (model/kernels.py, the n-gram and suffix indexes): "auto" (if it builds) | "on" | "off"
    kernels: str = "auto"
    huge_pages: bool = True          # CPU weights in huge pages where the OS offers them (model/memory.py)
    seed: int = 0
    device: str = "auto"             # "auto" (cuda when available, else cpu) | "cpu" | "cuda" | "cuda:N"
    tensor_parallel_size: int = 1    # ranks that shard the target (verispec.distributed); 1 = one process
    chat_template: str | None = None  # Jinja text that replaces the model's chat template (a path is read)
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
        if self.device != "auto" and self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device must be one of {('auto',) + DEVICES} (cuda may name an index, "
                             f"cuda:1), got {self.device!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if not isinstance(self.huge_pages, bool):
            raise ValueError(f"huge_pages must be true or false, got {self.huge_pages!r}")
        for name in ("weight_format", "draft_weight_format"):
            value = getattr(self, name)
            if value not in WEIGHT_FORMATS:
                raise ValueError(f"{name} must be one of {WEIGHT_FORMATS}, got {value!r}")
            if value not in ("auto", "dense") and self.dtype != "bfloat16":
                raise ValueError(f"{name} {value!r} needs dtype bfloat16, got {self.dtype!r}")
        if self.chat_template is not None:  # the text itself: the config records what ran
            object.__setattr__(self, "chat_template", load_chat_template(self.chat_template))

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
        """This config with `threads` chosen for `mode` ("serve" or "generate") if unset:
        per rank under tensor parallelism, the cores shared among the ranks on this machine
        (OMP_NUM_THREADS, when set, is already a process's, so a rank's)."""
        if self.threads is not None:
            return self
        if os.environ.get("OMP_NUM_THREADS", "").strip():
            return replace(self, threads=auto_threads(mode))
        return replace(self, threads=max(1, auto_threads(mode) // local_ranks(self.tensor_parallel_size)))


def load_chat_template(value: str) -> str:
    """The Jinja text of a chat template given as a file path or as the template itself
    (vLLM's --chat-template rule)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"chat template must be a file path or Jinja text, got {value!r}")
    if any(mark in value for mark in ("{{", "{%")):
        return value
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ValueError(f"chat template {value!r}: no such file, and it is not Jinja text "
                     "(no '{{' or '{%' in it)")


# vLLM's suffix decoding keys -> SpecConfig's fields (method "suffix" only).
SUFFIX_CONFIG_KEYS = {"suffix_decoding_max_cached_requests": "suffix_max_cached_requests",
                      "suffix_decoding_max_spec_factor": "suffix_max_spec_factor",
                      "suffix_decoding_min_token_prob": "suffix_min_token_prob"}
# vLLM's `speculative_config` keys -> verispec's; "adaptive" and "ngram_max"/"ngram_min"
# spell verispec's own settings. Values are checked by SpecConfig as usual.
SPECULATIVE_CONFIG_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max",
                           "prompt_lookup_min", "adaptive", "draft_tensor_parallel_size", *SUFFIX_CONFIG_KEYS)
# vLLM's method names -> verispec's; "none" and verispec's own names are accepted too.
SPECULATIVE_METHODS = {"ngram": "ngram", "draft_model": "draft", "draft": "draft", "suffix": "suffix",
                       "eagle": "eagle", "auto": AUTO, "none": "none"}


def spec_from_speculative_config(speculative_config: dict | str | None,
                                 base: SpecConfig | None = None) -> tuple[SpecConfig, dict[str, str]]:
    """(SpecConfig, the EngineConfig fields it names: draft_model or draft_head) for vLLM's
    `speculative_config` dict (or its JSON).

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}
    and {"model": DRAFT, "num_speculative_tokens": k} (method "draft_model", implied by "model")
    map onto verispec's n-gram and draft-model speculation; {"method": "suffix"} onto suffix
    decoding, with vLLM's suffix_decoding_max_cached_requests, _max_spec_factor and
    _min_token_prob;
    {"method": "eagle", "model": DIR} onto its EAGLE-style head in DIR (verispec's own head
    format, `verispec train-draft eagle`; without "model" the model's registered head);
    {"adaptive": false} fixes k. Keys not given keep `base`'s values (verispec's defaults:
    adaptive auto, each method's k_max (8, suffix 16), n-gram lengths 1..4). A lone
    prompt_lookup_max or _min keeps the other bound's default (clamped); vLLM copies it
    instead. Unknown keys and methods verispec lacks (eagle3, medusa, mtp...) are a
    ValueError naming the allowed ones.
    """
    import json

    base = base or SpecConfig()
    if speculative_config is None:
        return base, {}
    if isinstance(speculative_config, str):
        try:
            speculative_config = json.loads(speculative_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON ({exc})") from None
    if not isinstance(speculative_config, dict):
        raise ValueError(f"speculative_config must be a dict (a JSON object), got {speculative_config!r}")
    cfg = dict(speculative_config)
    unknown = sorted(set(cfg) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"speculative_config key(s) {unknown} not supported; allowed keys: "
                         f"{list(SPECULATIVE_CONFIG_KEYS)}")
    tp = cfg.get("draft_tensor_parallel_size")
    if tp not in (None, 1):
        raise ValueError(f"speculative_config draft_tensor_parallel_size must be 1 (verispec runs "
                         f"the draft in the engine's process), got {tp!r}")
    draft = cfg.get("model")
    if draft is not None and not (isinstance(draft, str) and draft):
        raise ValueError(f"speculative_config model must be a model name or path, got {draft!r}")
    method = cfg.get("method")
    if method is None:
        method = "draft" if draft else base.method
    elif method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config method {method!r} is not supported; allowed methods: "
                         f"{sorted(SPECULATIVE_METHODS)} (a draft model is implied by 'model')")
    else:
        method = SPECULATIVE_METHODS[method]
    if draft and method not in ("draft", "eagle"):
        raise ValueError(f"speculative_config model {draft!r} needs method 'draft_model' or 'eagle', got {method!r}")
    named = {("draft_head" if method == "eagle" else "draft_model"): draft} if draft else {}
    spec = asdict(base)
    spec["method"] = method
    if "num_speculative_tokens" in cfg:
        spec["num_spec_tokens"] = _int_key(cfg, "num_speculative_tokens")
    if "adaptive" in cfg:
        if not isinstance(cfg["adaptive"], bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got {cfg['adaptive']!r}")
        spec["adaptive"] = cfg["adaptive"]
    lo, hi = cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max")
    if lo is not None or hi is not None:
        if method not in ("ngram", AUTO):
            raise ValueError("speculative_config prompt_lookup_min/prompt_lookup_max need method 'ngram' or 'auto'")
        hi = _int_key(cfg, "prompt_lookup_max") if hi is not None else max(spec["ngram_max"], lo)
        lo = _int_key(cfg, "prompt_lookup_min") if lo is not None else min(spec["ngram_min"], hi)
        spec["ngram_min"], spec["ngram_max"] = lo, hi
    for key in sorted(set(cfg) & set(SUFFIX_CONFIG_KEYS)):
        if method != "suffix":
            raise ValueError(f"speculative_config {key} needs method 'suffix', got {method!r}")
        if key == "suffix_decoding_max_cached_requests":
            _int_key(cfg, key)
        spec[SUFFIX_CONFIG_KEYS[key]] = cfg[key]
    return SpecConfig(**spec), named


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_key(cfg: dict, key: str) -> int:
    value = cfg[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"speculative_config {key} must be an integer, got {value!r}")
    return value


# Above this many cores `serve` leaves one to the HTTP front end (auto_threads).
SERVE_SPARE_CORE_ABOVE = 8


def auto_threads(mode: str) -> int:
    """Intra-op threads when none are set: OMP_NUM_THREADS when the environment sets it,
    else one per physical core this process may run on.

    `serve` keeps them all on small machines: its front end is a separate process that
    used 3-5% of one core at 1 and 16 streams on two cores, where leaving it a whole core
    cost the engine 38% (1 thread: 103 tok/s, 2: 166). Above SERVE_SPARE_CORE_ABOVE cores
    a core is at most 1/9 of the compute, and a front-end wake-up that pre-empts one thread
    of a wide OpenMP team stalls every thread at the next barrier, so it gets its own.
    """
    if mode not in ("serve", "generate"):
        raise ValueError(f"mode must be 'serve' or 'generate', got {mode!r}")
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp:   # the user's (or a job scheduler's) choice, as torch itself honours it
        if not omp.isdigit() or int(omp) < 1:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {omp!r}")
        return int(omp)
    cores = physical_cores()
    return cores - 1 if mode == "serve" and cores > SERVE_SPARE_CORE_ABOVE else cores


def local_ranks(tensor_parallel_size: int) -> int:
    """The engine's ranks that share this machine's cores: all of them when the engine
    starts them; torchrun's LOCAL_WORLD_SIZE when torchrun does (ranks may span machines)."""
    if tensor_parallel_size > 1 and "TORCHELASTIC_RUN_ID" in os.environ:
        return int(os.environ.get("LOCAL_WORLD_SIZE", tensor_parallel_size))
    return tensor_parallel_size


def physical_cores() -> int:
    """Cores in this process's CPU affinity, hyperthread siblings counted once."""
    return max(1, len(core_cpus()))


def core_cpus() -> list[list[int]]:
    """The CPUs of this process's affinity grouped by physical core (hyperthread siblings
    together), cores in the order of their first CPU; a CPU without topology is its own core."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(cpus):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = (topo.joinpath("physical_package_id").read_text().strip(),
                   topo.joinpath("core_id").read_text().strip())
        except OSError:
            key = ("cpu", str(cpu))
        cores.setdefault(key, []).append(cpu)
    return list(cores.values())


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
    g.add_argument("--draft-head", metavar="DIR", help="EAGLE-style draft head for --spec eagle "
                   "(default: the one registered for the model; `verispec train-draft eagle` trains one)")
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
                   help="C++ code: the fused CPU kernels of the decode step and the n-gram and suffix "
                        "indexes: auto (default: used when they compile), on (an error if they do not), "
                        "off (PyTorch ops and Python indexes only)")
    g.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=None,
                   help="copy the CPU weights into memory backed by 2 MiB pages where Linux offers "
                        "transparent huge pages (default on: fewer TLB misses while a step streams them)")
    g.add_argument("--spec", choices=spec_methods(),
                   help="speculation method (default auto: n-gram, or the head where one is registered)")
    g.add_argument("--num-spec-tokens", type=int,
                   help="k (k_max when adaptive; default: the method's, 16 for suffix, else 8)")
    g.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="choose k per step from measured acceptance and cost (default on)")
    g.add_argument("--suffix-max-cached-requests", type=int, metavar="N",
                   help="finished outputs suffix decoding keeps to draft from (default: as many as its "
                        "trie's node budget holds; 0: none, nothing shared between requests)")
    g.add_argument("--speculative-config", metavar="JSON",
                   help='vLLM\'s speculative config as JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or \'{"model": DRAFT, '
                        '"num_speculative_tokens": 5}\' (instead of --spec/--num-spec-tokens/--draft-model)')
    g.add_argument("--kv-tokens", type=int, help="KV pool capacity in tokens")
    g.add_argument("--block-size", type=int)
    g.add_argument("--no-prefix-cache", action="store_true", default=None)
    g.add_argument("--max-num-seqs", type=int, help="running requests at once (default 32)")
    g.add_argument("--max-num-batched-tokens", type=int,
                   help="tokens per engine step: prefill chunks + verify rows (default 512)")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--chat-template", metavar="PATH_OR_TEMPLATE",
                   help="Jinja chat template (a file, or the template text) replacing the model's")
    g.add_argument("--seed", type=int)
    g.add_argument("--device", help="where the engine runs: auto (default: cuda when available, "
                   "else cpu), cpu, cuda or cuda:N")
    g.add_argument("--tensor-parallel-size", "-tp", type=int,
                   help="shard the target model across this many ranks (default 1)")
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
    _set(top, "draft_head", getattr(args, "draft_head", None))
    _set(top, "dtype", args.dtype)
    _set(top, "weight_format", getattr(args, "weight_format", None))
    _set(top, "draft_weight_format", getattr(args, "draft_weight_format", None))
    _set(top, "seed", args.seed)
    _set(top, "device", getattr(args, "device", None))
    _set(top, "tensor_parallel_size", getattr(args, "tensor_parallel_size", None))
    _set(top, "threads", getattr(args, "threads", None))
    _set(top, "kernels", getattr(args, "kernels", None))
    _set(top, "huge_pages", getattr(args, "huge_pages", None))
    _set(top, "chat_template", getattr(args, "chat_template", None))
    _set(spec, "method", args.spec)
    if args.spec is None and args.draft_model and not getattr(args, "config", None):
        spec["method"] = "draft"   # naming a draft model means you want to use it
    _set(spec, "num_spec_tokens", args.num_spec_tokens)
    _set(spec, "adaptive", args.spec_adaptive)
    _set(spec, "suffix_max_cached_requests", getattr(args, "suffix_max_cached_requests", None))
    if getattr(args, "speculative_config", None) is not None:
        clash = [flag for flag, value in (("--spec", args.spec), ("--num-spec-tokens", args.num_spec_tokens),
                                          ("--spec-adaptive", args.spec_adaptive),
                                          ("--suffix-max-cached-requests",
                                           getattr(args, "suffix_max_cached_requests", None)),
                                          ("--draft-model", args.draft_model)) if value is not None]
        if clash:
            raise ValueError(f"--speculative-config cannot be combined with {', '.join(clash)}: "
                             "say it in one of them")
        spec_cfg, named = spec_from_speculative_config(args.speculative_config, SpecConfig(**spec))
        if "draft_head" in named and getattr(args, "draft_head", None) is not None:
            raise ValueError("--speculative-config's model and --draft-head both name the head: say it in one")
        spec = asdict(spec_cfg)
        top.update(named)
    _set(cache, "num_kv_tokens", args.kv_tokens)
    _set(cache, "block_size", args.block_size)
    if args.no_prefix_cache:
        cache["prefix_cache"] = False
    _set(sched, "max_num_seqs", args.max_num_seqs)
    _set(sched, "max_num_batched_tokens", getattr(args, "max_num_batched_tokens", None))
    _set(sched, "max_model_len", args.max_model_len)
    return EngineConfig.from_dict({**top, "spec": spec, "cache": cache, "scheduler": sched})


def _set(d: dict, key: str, value) -> None:
    if value is not None:
        d[key] = value
