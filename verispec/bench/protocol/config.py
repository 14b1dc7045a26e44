"""BenchConfig: every setting of one benchmark run, validated once and recorded in run.json."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BenchConfig:
    """The resolved configuration of a run (the API key is deliberately not part of it)."""

    base_url: str
    dataset: str
    out_dir: str
    model: str | None = None
    config_name: str = "default"
    max_tokens: int = 256
    num_prompts: int | None = None      # per dataset; None = all
    passes: int = 3
    warmup: int = 2
    seed: int = 0
    temperature: float = 0.0
    concurrency: int = 1
    request_timeout_s: float = 600.0
    metrics_url: str | None = None      # None = <server root>/metrics
    scrape_metrics: bool = True
    continuous_usage: bool = True       # ask for cumulative usage in every chunk
    request_seeds: bool = False         # send a per-(prompt, turn) seed with each request
    extra_body_json: str = "{}"         # merged into every request body
    progress: bool = True
    launched_engine_args: str | None = None  # `verispec serve` flags when --launch started it
    launched_peer: str | None = None         # the llama-server command line, when one was launched
    fresh_server_per_request: bool = False   # a new llama-server for every request

    def __post_init__(self):
        _check(self.base_url.startswith(("http://", "https://")),
               f"base_url must start with http:// or https://, got {self.base_url!r}")
        _check(bool(self.dataset), "dataset must be non-empty")
        _check(bool(self.config_name), "config_name must be non-empty")
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.num_prompts is None or self.num_prompts >= 1,
               f"num_prompts must be >= 1, got {self.num_prompts}")
        _check(self.passes >= 1, f"passes must be >= 1, got {self.passes}")
        _check(self.warmup >= 0, f"warmup must be >= 0, got {self.warmup}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(self.concurrency >= 1, f"concurrency must be >= 1, got {self.concurrency}")
        _check(self.request_timeout_s > 0,
               f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        try:
            extra = json.loads(self.extra_body_json)
        except json.JSONDecodeError as e:
            raise ValueError(f"extra_body must be a JSON object: {e.msg}") from None
        _check(isinstance(extra, dict), "extra_body must be a JSON object")
        _check(not ({"stream", "stream_options", "messages"} & set(extra)),
               "extra_body must not override stream, stream_options or messages: the "
               "harness needs streamed usage to measure")

    @property
    def extra_body(self) -> dict:
        return json.loads(self.extra_body_json)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["extra_body"] = self.extra_body
        return d


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
