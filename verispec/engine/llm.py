"""LLM: the synchronous Python API over the engine.

    from verispec import LLM, SamplingParams
    llm = LLM()                                  # the embedded default model, n-gram drafting
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].text, outs[0].spec.acceptance_rate)
"""
from __future__ import annotations

from dataclasses import replace

from verispec.config import EngineConfig, SpecConfig
from verispec.engine.engine import LLMEngine, SpecOverride
from verispec.outputs import RequestOutput
from verispec.sampling import SamplingParams


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", draft: str | None = None,
                 spec: str | SpecConfig = "ngram", dtype: str = "bfloat16",
                 config: EngineConfig | None = None, **engine_options):
        """Build an engine; `spec` is a method name or a full SpecConfig."""
        if config is None:
            spec_cfg = spec if isinstance(spec, SpecConfig) else SpecConfig(method=spec)
            config = EngineConfig(model=model, draft_model=draft, dtype=dtype, spec=spec_cfg)
        if engine_options:
            config = replace(config, **engine_options)
        self.engine = LLMEngine.from_config(config.resolved_for("generate"))
        self.config = self.engine.config  # resolved (e.g. the registered draft's directory)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts: list[str | list[int]] | str, params: SamplingParams | list[SamplingParams] | None = None,
                 spec: SpecOverride | None = None) -> list[RequestOutput]:
        """Run every prompt concurrently through the scheduler; outputs come back in order.

        A prompt is a string (encoded as is) or a list of token ids.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, params_list):
            rid = f"llm-{self._next_id}"
            self._next_id += 1
            tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.engine.add_request(rid, tokens, p, spec)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def chat(self, conversations: list[list[dict]], params: SamplingParams | None = None,
             spec: SpecOverride | None = None) -> list[RequestOutput]:
        """Like generate, for chat conversations rendered with the model's chat template."""
        return self.generate([self.tokenizer.encode_chat(c) for c in conversations], params, spec)
