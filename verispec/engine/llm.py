"""LLM: the synchronous Python API over the engine, in vLLM's offline shape.

    from verispec import LLM, SamplingParams
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, top_p=0.95))
    for o in outputs:
        print(o.prompt, o.outputs[0].text, o.spec.acceptance_rate)

As in vLLM, SamplingParams.n asks for n completions of each prompt (with a seed s,
completion i is seeded s + i: verispec.request.choice_params, the server's rule for `n`),
and generate/chat without sampling_params use the model's generation-config defaults
(`get_default_sampling_params`; generation_config="vllm" for neutral ones).

Differences from vLLM (README "Coming from vLLM" has the full list): with no
`speculative_config` verispec still speculates (adaptive auto, lossless) where vLLM
does not; pass {"method": "none"} to turn it off. SamplingParams.max_tokens defaults to
256 (vLLM: 16). Prompt log-probabilities are not supported yet. Keyword arguments vLLM
has and verispec cannot honour are a ValueError; a few that cannot change anything here
(gpu_memory_utilization, swap_space, enforce_eager, trust_remote_code, disable_log_stats)
are accepted and ignored: `LLM_NOOP_OPTIONS`.
"""
from __future__ import annotations

import sys
from dataclasses import fields, replace

from verispec.config import GENERATION_CONFIGS, EngineConfig, SpecConfig, spec_from_speculative_config
from verispec.engine.engine import LLMEngine, SpecOverride
from verispec.model.tokenizer import Tokenizer
from verispec.outputs import CompletionOutput, LLMRequestOutput, Logprob, RequestOutput, SpecStats
from verispec.request import choice_params
from verispec.sampling import SamplingParams

# vLLM's options that change nothing in verispec (a CPU engine: the KV pool is sized by
# num_kv_tokens, preemption recomputes instead of swapping, there are no CUDA graphs, and
# only built-in architectures run: no model code is ever loaded from a repository).
LLM_NOOP_OPTIONS = ("gpu_memory_utilization", "swap_space", "enforce_eager", "trust_remote_code",
                    "disable_log_stats")
# vLLM's options verispec cannot honour: accepted only at the value that asks for nothing.
LLM_UNSUPPORTED_OPTIONS = {
    "pipeline_parallel_size": 1, "data_parallel_size": 1,
    "quantization": None, "kv_cache_dtype": "auto", "enable_lora": False, "cpu_offload_gb": 0,
    "tokenizer_mode": "auto", "skip_tokenizer_init": False, "revision": None, "tokenizer_revision": None,
    "download_dir": None, "load_format": "auto",
}
_HINTS = {"quantization": " (verispec's weight_format= picks int8/int4 weights)",
          "pipeline_parallel_size": " (tensor_parallel_size= splits a model across ranks)"}
# EngineConfig fields LLM(...) takes by name; the nested ones have vLLM's names below.
_ENGINE_FIELDS = tuple(f.name for f in fields(EngineConfig) if f.name not in ("model", "spec", "cache", "scheduler"))
_DTYPES = {"auto": None, "bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "float": "float32"}


class LLM:
    def __init__(self, model: str | None = None, *, speculative_config: dict | None = None,
                 dtype: str = "auto", seed: int | None = None, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool | None = None, block_size: int | None = None,
                 num_kv_tokens: int | None = None, tokenizer: str | None = None,
                 chat_template: str | None = None, draft: str | None = None,
                 spec: str | SpecConfig | None = None, config: EngineConfig | None = None,
                 generation_config: str = "auto", **engine_options):
        """Build an engine from vLLM's arguments onto one frozen EngineConfig.

        model: registry name, .gguf file or Hugging Face directory (None: the default model).
        speculative_config: vLLM's dict (config.spec_from_speculative_config); None keeps
        verispec's default speculation. dtype: "auto" (bfloat16), "bfloat16" or "float32".
        block_size / num_kv_tokens size the KV pool. generation_config: where the default
        sampling values come from, "auto" (the model's generation_config.json) or "vllm"
        (neutral), as the server's --generation-config. verispec's own: `spec` (a method name
        or a SpecConfig), `draft` (a draft model), `config` (a whole EngineConfig the other
        arguments override), and any EngineConfig field (weight_format, threads, kernels...).
        """
        if generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config {generation_config!r} is not supported; allowed: "
                             "'auto' (the model's generation_config.json) or 'vllm' (neutral defaults)")
        self.generation_config = generation_config
        base = config or EngineConfig()
        top: dict = {}
        if model is not None:
            top["model"] = model
        if tokenizer is not None and tokenizer != (model or base.model):
            raise ValueError(f"tokenizer {tokenizer!r}: verispec reads the model's own tokenizer; "
                             "a separate one is not supported")
        key = str(dtype).removeprefix("torch.")
        if key not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; allowed: {sorted(_DTYPES)}")
        if _DTYPES[key]:
            top["dtype"] = _DTYPES[key]
        if seed is not None:
            top["seed"] = seed
        if chat_template is not None:
            top["chat_template"] = chat_template
        for name, value in engine_options.items():
            if name in LLM_NOOP_OPTIONS:
                continue
            if name in LLM_UNSUPPORTED_OPTIONS:
                if value != LLM_UNSUPPORTED_OPTIONS[name]:
                    raise ValueError(f"{name}={value!r} is not supported by verispec{_HINTS.get(name, '')}; "
                                     f"only {LLM_UNSUPPORTED_OPTIONS[name]!r}")
                continue
            if name not in _ENGINE_FIELDS:
                raise ValueError(f"unknown LLM option {name!r}; verispec's engine options: "
                                 f"{list(_ENGINE_FIELDS)}, vLLM's accepted as no-ops: {list(LLM_NOOP_OPTIONS)}")
            top[name] = value

        spec_cfg, named = base.spec, ({"draft_model": draft} if draft is not None else {})
        if speculative_config is not None:
            if spec is not None or draft is not None:
                raise ValueError("pass speculative_config or verispec's spec=/draft=, not both")
            spec_cfg, named = spec_from_speculative_config(speculative_config, base.spec)
        elif isinstance(spec, SpecConfig):
            spec_cfg = spec
        elif spec is not None:
            spec_cfg = replace(base.spec, method=spec)
        elif draft is not None:
            spec_cfg = replace(base.spec, method="draft")  # naming a draft means using it
        top.update(named)

        sched = {k: v for k, v in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs),
                                   ("max_num_batched_tokens", max_num_batched_tokens)) if v is not None}
        cache = {k: v for k, v in (("prefix_cache", enable_prefix_caching), ("block_size", block_size),
                                   ("num_kv_tokens", num_kv_tokens)) if v is not None}
        config = replace(base, **top, spec=spec_cfg, scheduler=replace(base.scheduler, **sched),
                         cache=replace(base.cache, **cache))
        self.engine = LLMEngine.from_config(config.resolved_for("generate"))
        self.config = self.engine.config  # resolved (e.g. the registered draft's directory)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine underneath."""
        return self.engine

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what generate/chat use without sampling_params. With generation_config
        "auto", the model's recommended temperature, top_p, top_k, min_p and
        repetition_penalty (TokenizerMeta.sampling_defaults), the rest SamplingParams'
        defaults; with "vllm", SamplingParams() (neutral)."""
        if self.generation_config == "vllm":
            return SamplingParams()
        meta = getattr(self.tokenizer, "meta", None)
        return SamplingParams(**(getattr(meta, "sampling_defaults", None) or {}))

    # ------------------------------------------------------------------ generate
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm=True, spec: SpecOverride | None = None,
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[LLMRequestOutput]:
        """Run every prompt concurrently through the scheduler; outputs come back in order.

        prompts: a string, a {"prompt": str} or {"prompt_token_ids": [...]} dict (vLLM's
        TextPrompt / TokensPrompt), a list of token ids, or a list of any of these.
        sampling_params: one SamplingParams for all, or one per prompt (None:
        get_default_sampling_params(); `params=` is the earlier spelling); its `n` asks for n
        completions of the prompt, `outputs[0..n-1]`. use_tqdm: a progress bar on stderr when
        it is a terminal (or a tqdm-like class to use). spec: verispec's per-request
        speculation override. A request that fails alone comes back with `.error` set.
        """
        if params is not None:
            if sampling_params is not None:
                raise ValueError("pass sampling_params or params, not both")
            sampling_params = params
        items = self._normalise_prompts(prompts)
        params_list = self._params_for(sampling_params, len(items))
        encoded = [(text, list(ids) if ids is not None else self.tokenizer.encode(text)) for text, ids in items]
        return self._run(encoded, params_list, spec, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm=True, chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None, spec: SpecOverride | None = None,
             params: SamplingParams | list[SamplingParams] | None = None) -> list[LLMRequestOutput]:
        """Like generate, for one conversation (a list of message dicts) or several (a list of
        such lists), rendered with the model's chat template or `chat_template` (Jinja text
        or a file). A message's content may be a string or a list of {"type": "text"} parts.
        Each output's `prompt` is the rendered conversation."""
        if params is not None:
            if sampling_params is not None:
                raise ValueError("pass sampling_params or params, not both")
            sampling_params = params
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"messages must be a list of message dicts or a list of such lists, got {messages!r}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self._tokenizer_with(chat_template)
        encoded = []
        for i, conv in enumerate(conversations):
            if not isinstance(conv, (list, tuple)):
                raise ValueError(f"conversation {i} must be a list of message dicts, got {conv!r}")
            text = tok.apply_chat_template([_text_message(m) for m in conv],
                                           add_generation_prompt=add_generation_prompt,
                                           **(chat_template_kwargs or {}))
            encoded.append((text, tok.encode(text, add_special_tokens=False)))
        params_list = self._params_for(sampling_params, len(encoded))
        return self._run(encoded, params_list, spec, use_tqdm)

    # ------------------------------------------------------------------ internals
    def _run(self, encoded: list[tuple[str | None, list[int]]], params_list: list[SamplingParams],
             spec: SpecOverride | None, use_tqdm) -> list[LLMRequestOutput]:
        """Add every prompt's n completions as engine requests (`llm-<i>`, or `llm-<i>-<j>`
        for n > 1, seeded by choice_params), step until all finish, gather them per prompt."""
        groups: list[tuple[str, list[tuple[str, SamplingParams]]]] = []  # per prompt: its choices
        for (_, tokens), p in zip(encoded, params_list):
            rid = f"llm-{self._next_id}"
            self._next_id += 1
            n = p.n
            choices = [(rid if n == 1 else f"{rid}-{j}", choice_params(p, j)) for j in range(n)]
            for cid, cp in choices:
                self.engine.add_request(cid, tokens, cp, spec)
            groups.append((rid, choices))
        group_of = {cid: g for g, (_, choices) in enumerate(groups) for cid, _ in choices}
        left = [len(choices) for _, choices in groups]
        bar = _progress_bar(use_tqdm, len(groups))  # counts prompts, as vLLM's does
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(group_of):
                for out in self.engine.step():
                    if out.finished and out.request_id in group_of and out.request_id not in final:
                        final[out.request_id] = out
                        g = group_of[out.request_id]
                        left[g] -= 1
                        if bar is not None and left[g] == 0:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [self._result(rid, text, [(final[cid], cp) for cid, cp in choices])
                for (text, _), (rid, choices) in zip(encoded, groups)]

    def _result(self, request_id: str, prompt: str | None,
                choices: list[tuple[RequestOutput, SamplingParams]]) -> LLMRequestOutput:
        """One prompt's result: its completions in order; `spec` sums theirs, `error` is the
        first one's that failed."""
        outs = [out for out, _ in choices]
        first = outs[0]
        return LLMRequestOutput(request_id=request_id, prompt=prompt,
                                prompt_token_ids=list(first.prompt_token_ids),
                                outputs=[self._completion(j, out, p) for j, (out, p) in enumerate(choices)],
                                finished=all(out.finished for out in outs),
                                spec=first.spec if len(outs) == 1 else SpecStats.summed([o.spec for o in outs]),
                                error=next((out.error for out in outs if out.error is not None), None),
                                num_cached_tokens=getattr(first, "num_cached_tokens", None))

    def _completion(self, index: int, out: RequestOutput, params: SamplingParams) -> CompletionOutput:
        logprobs = cumulative = None
        if out.logprobs is not None:  # vLLM's shape: per token {id: Logprob}, the token first
            logprobs = [self._logprob_dict(t, entry) for t, entry in zip(out.token_ids, out.logprobs)]
            cumulative = sum(lp for lp, _ in out.logprobs)
        return CompletionOutput(index=index, text=out.text, token_ids=list(out.token_ids),
                                cumulative_logprob=cumulative, logprobs=logprobs,
                                finish_reason=out.finish_reason,
                                stop_reason=self._stop_reason(out, params))

    def _stop_reason(self, out: RequestOutput, params: SamplingParams) -> int | str | None:
        """vLLM's stop_reason: the stop token id or stop string that ended it, else None."""
        if out.finish_reason != "stop" or not out.token_ids:
            return None
        last = out.token_ids[-1]
        if last in (getattr(params, "stop_token_ids", None) or ()) and last not in self.tokenizer.eos_token_ids:
            return last
        if params.stop:
            rest = self.tokenizer.decode(out.token_ids)[len(out.text):]
            hits = [s for s in params.stop if s in rest]
            return min(hits, key=rest.index) if hits else None
        return None

    @staticmethod
    def _normalise_prompts(prompts) -> list[tuple[str | None, list[int] | None]]:
        """[(text or None, token ids or None)] for every prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a prompt dict or a list of them, got {type(prompts).__name__}")
        items = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                items.append((prompt, None))
            elif isinstance(prompt, dict):
                extra = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
                if extra or len(prompt) != 1:
                    raise ValueError(f"prompt {i}: a prompt dict has exactly one of 'prompt' (text) or "
                                     f"'prompt_token_ids'; got keys {sorted(prompt)}")
                if "prompt" in prompt:
                    if not isinstance(prompt["prompt"], str):
                        raise ValueError(f"prompt {i}: 'prompt' must be a string")
                    items.append((prompt["prompt"], None))
                else:
                    items.append((None, _token_ids(prompt["prompt_token_ids"], i)))
            elif isinstance(prompt, (list, tuple)):
                items.append((None, _token_ids(prompt, i)))
            else:
                raise ValueError(f"prompt {i} must be a string, a list of token ids or a prompt dict "
                                 f"(e.g. {{'prompt_token_ids': [...]}}), got {type(prompt).__name__}")
        return items

    def _params_for(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * n
        if len(params_list) != n:
            raise ValueError(f"got {len(params_list)} SamplingParams for {n} prompts")
        for p in params_list:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be verispec.SamplingParams, got {type(p).__module__}."
                                 f"{type(p).__name__}")
            if getattr(p, "prompt_logprobs", None) is not None:
                raise ValueError("prompt_logprobs are not supported yet")
        return params_list

    def _logprob_dict(self, token: int, entry) -> dict:
        lp, top = entry
        ranks = {t: i + 1 for i, (t, _) in enumerate(top)}
        out = {token: Logprob(lp, ranks.get(token), self.tokenizer.decode([token]))}
        for t, v in top:
            out.setdefault(t, Logprob(v, ranks[t], self.tokenizer.decode([t])))
        return out

    def _tokenizer_with(self, chat_template: str | None) -> Tokenizer:
        """The tokenizer, with `chat_template` (Jinja text or a file) instead of its own."""
        if chat_template is None:
            return self.tokenizer
        from verispec.config import load_chat_template
        text = load_chat_template(chat_template)
        cache = self.__dict__.setdefault("_template_tokenizers", {})
        if text not in cache:
            cache[text] = Tokenizer(self.tokenizer.backend, replace(self.tokenizer.meta, chat_template=text))
        return cache[text]


def _token_ids(ids, i: int) -> list[int]:
    ids = list(ids)
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"prompt {i}: token ids must be a non-empty list of integers")
    return ids


def _text_message(message):
    """A message whose content is a list of {"type": "text", "text": ...} parts, as one
    string (vLLM's "string" content format); other messages as they are."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    parts = message["content"]
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            texts.append(part.get("text", ""))
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"message content part of type {kind!r} is not supported (text only)")
    return {**message, "content": "\n".join(texts)}


def _progress_bar(use_tqdm, total: int):
    """vLLM's "Processed prompts" bar on stderr, only when it is a terminal; or use_tqdm(...)
    when it is a tqdm-like class."""
    if not use_tqdm or total == 0:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
    if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, file=sys.stderr)
