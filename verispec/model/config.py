"""ModelConfig: the architecture hyper-parameters of one Llama-family model."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

# HF `architectures` / GGUF `general.architecture` -> our family name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}


class UnsupportedArchitecture(ValueError):
    pass


def family_of(arch: str) -> str:
    """Map an HF or GGUF architecture name to our family, or raise naming the supported ones."""
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = sorted({a for a in SUPPORTED_ARCHITECTURES if "For" in a})
        raise UnsupportedArchitecture(
            f"unsupported architecture {arch!r}; supported: {', '.join(supported)} "
            "(Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3)")
    return SUPPORTED_ARCHITECTURES[arch]


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder. Built once, never mutated."""

    family: str                      # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int                  # rows of the embedding / lm_head (may exceed the tokenizer's)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # q/k/v projection bias (Qwen2)
    qk_norm: bool = False             # RMSNorm on q and k per head (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "") -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict."""
        arch = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0]
        family = family_of(arch)
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def _rope_scaling(cfg: dict) -> dict | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind == "default" else dict(scaling)
