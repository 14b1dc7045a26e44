"""A small, deterministic stand-in for LLMEngine that the server tests drive.

It implements the engine contract the server builds against (add_request / abort_request /
step / has_unfinished_requests / stats / check_integrity, a tokenizer, model_name,
max_model_len, spec_method) with pure Python:

- a byte tokenizer (one token per UTF-8 byte, ids 256.. are specials), so token counts
  are exact and easy to check;
- greedy output that is a pure function of the token history (a hash picks the next
  letter), so a request run inside a busy batch produces exactly what it produces alone;
- simulated speculation: each decode round "drafts" k tokens, of which a hash-chosen
  prefix is accepted, and emits accepted + 1 tokens; the output does not depend on k,
  just as real speculative decoding must not change it;
- a block pool (block_size tokens per block) with check_integrity();
- hooks for the tests: a step delay, and prompts containing FAIL_STEP (step() raises),
  FAIL_REQUEST (that request alone fails with RequestOutput.error) or HANG_STEP (the
  first step that runs it sleeps `hang_s`: a wedged engine);
- `CostlyByteTokenizer`: the same tokens, at the price of the real tokenizer (the
  tokenizers library holds the interpreter lock for a whole encode).

Run as a script it serves itself over HTTP (the subprocess the HTTP tests start):
    python tests/fake_engine.py --port 8123 [--step-delay 0.002] [server flags]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":  # running as a script: make `verispec` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from verispec.outputs import RequestOutput, SpecStats  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402

from verispec.engine.messages import EngineStats  # noqa: E402
from verispec.request import SpecOverride  # noqa: E402,F401

EOS = 256
BOS = 257
LETTERS = b"abcdefghijklmnopqrstuvwxyz     "  # spaces weighted so text looks like words


# A prompt containing TOOL_CALL gets this output (then EOS), whatever the sampling: two
# Hermes/Qwen-style tool calls after some text (the tool-calling tests).
TOOL_CALL_OUTPUT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')


class ByteTokenizer:
    """One token per UTF-8 byte; 256 = EOS, 257 = BOS (chat prompts start with it). Its
    chat template renders tools (as a `<|tools|>` JSON line) unless supports_tools is False."""

    eos_token_ids = (EOS,)
    vocab_size = 258
    supports_tools = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        import json
        text = f"<|tools|>{json.dumps(tools)}\n" if tools else ""
        for m in messages:
            calls = "".join(f"<tool_call>{json.dumps(c['function'])}</tool_call>" for c in m.get("tool_calls", ()))
            text += f"<|{m['role']}|>{m['content']}{calls}\n"
        return text + ("<|assistant|>" if add_generation_prompt else "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        return [BOS] + self.encode(self.apply_chat_template(messages, add_generation_prompt, tools))


class CostlyByteTokenizer(ByteTokenizer):
    """ByteTokenizer whose encode also runs the default model's real tokenizer on the text
    (result discarded): the real cost, with the fake's exact one-token-per-byte counts."""

    def __init__(self):
        from verispec.model.loader import load_config_and_tokenizer, resolve_model
        self.real = load_config_and_tokenizer(resolve_model("smollm2-135m-instruct"))[1]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.real.encode(text)
        return super().encode(text)


def greedy_next(history: list[int], allow_eos: bool) -> int:
    """The fake model's argmax: a pure function of the last 12 tokens and the length."""
    h = zlib.crc32(repr((history[-12:], len(history))).encode())
    if allow_eos and h % 29 == 0:
        return EOS
    return LETTERS[(h >> 8) % len(LETTERS)]


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    method: str
    k: int
    rng: random.Random
    output: list[int] = field(default_factory=list)
    text: str = ""
    blocks: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    fail_step: bool = False
    fail_request: bool = False
    hang: bool = False
    canned: bytes = b""      # TOOL_CALL in the prompt: the output is TOOL_CALL_OUTPUT
    cached: int = 0          # prompt tokens found in the prefix cache when admitted


class FakeEngine:
    """Deterministic, pure-Python engine with the LLMEngine interface (see module doc)."""

    def __init__(self, *, model_name: str = "fake-model", max_model_len: int = 512,
                 max_num_seqs: int = 8, block_size: int = 16, spec_method: str = "ngram",
                 num_spec_tokens: int = 3, has_draft: bool = False, step_delay_s: float = 0.0,
                 leak_blocks_on_abort: bool = False, hang_s: float = 20.0, costly_tokenizer: bool = False,
                 tools_template: bool = True):
        self.model_name = model_name
        self.tokenizer = CostlyByteTokenizer() if costly_tokenizer else ByteTokenizer()
        self.tokenizer.supports_tools = tools_template  # False: like SmolLM2's template
        self.hang_s = hang_s
        self.max_model_len = max_model_len
        self.spec_method = spec_method
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.num_spec_tokens = num_spec_tokens
        self.has_draft = has_draft
        self.step_delay_s = step_delay_s
        self.leak_blocks_on_abort = leak_blocks_on_abort  # an injected bug for tests
        self.kv_blocks_total = max_num_seqs * -(-(max_model_len + num_spec_tokens + 1) // block_size)
        self.free_blocks = list(range(self.kv_blocks_total))
        self.leaked: list[int] = []
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.requests: dict[str, _Request] = {}
        self.cached_prefixes: set[bytes] = set()
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.steps = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    spec: SpecOverride | None = None) -> None:
        """Queue a request; raises ValueError naming the problem for bad input."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < self.tokenizer.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.tokenizer.vocab_size})")
        n = len(prompt_token_ids)
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} with a {n}-token prompt exceeds the "
                             f"context of {self.max_model_len} tokens")
        method = (spec.method if spec and spec.method else None) or self.spec_method
        if method not in ("ngram", "draft", "none"):
            raise ValueError(f"speculative.method must be 'none', 'ngram' or 'draft', got {method!r}")
        if method == "draft" and not self.has_draft:
            raise ValueError("speculative.method 'draft' needs the server to be started with a draft model")
        k = spec.num_tokens if spec and spec.num_tokens is not None else self.num_spec_tokens
        if not 0 <= k <= 16:
            raise ValueError(f"speculative.num_tokens must be an integer in [0, 16], got {k!r}")
        text = bytes(t for t in prompt_token_ids if t < 256)
        req = _Request(request_id, list(prompt_token_ids), params, "none" if k == 0 else method, k,
                       random.Random(params.seed), fail_step=b"FAIL_STEP" in text,
                       fail_request=b"FAIL_REQUEST" in text, hang=b"HANG_STEP" in text,
                       canned=TOOL_CALL_OUTPUT.encode() if b"TOOL_CALL" in text else b"")
        self.requests[request_id] = req
        self.waiting.append(req)

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its blocks at once; no-op if unknown or finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if self.leak_blocks_on_abort:
            self.leaked.extend(req.blocks)
            req.blocks = []
        self._free(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> EngineStats:
        used = self.kv_blocks_total - len(self.free_blocks)
        return EngineStats(len(self.running), len(self.waiting), used, self.kv_blocks_total,
                           self.prefix_hit_tokens, self.prefix_query_tokens)

    def check_integrity(self) -> None:
        """Free + held by requests == total, with no block in two places."""
        held = [b for r in self.requests.values() for b in r.blocks]
        everything = held + self.free_blocks
        assert len(set(everything)) == len(everything), "a KV block is in two places"
        assert len(everything) == self.kv_blocks_total, (
            f"{self.kv_blocks_total - len(everything)} KV blocks are neither free nor held by a request")

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests (their first token), then one decode round for the rest."""
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.steps += 1
        if any(r.fail_step for r in self.running):
            raise RuntimeError("injected step failure (FAIL_STEP in a running prompt)")
        for req in self.running:
            if req.hang:
                req.hang = False
                time.sleep(self.hang_s)
        outputs = []
        for req in list(self.running):
            outputs.append(self._decode(req))
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.pop(0)
            self.running.append(req)
            req.cached = self._count_prefix(req.prompt)
            outputs.append(self._emit(req, [self._next(req)], k=None))
        return outputs

    def _decode(self, req: _Request) -> RequestOutput:
        if req.fail_request:
            return self._finish(req, "abort", [], "", error="injected request failure")
        if req.method == "none":
            return self._emit(req, [self._next(req)], k=None)
        k = min(req.k, req.params.max_tokens - len(req.output) - 1)
        if k <= 0:
            return self._emit(req, [self._next(req)], k=None)
        verdict = zlib.crc32(repr(req.prompt[-4:] + req.output[-4:]).encode())
        accepted = min(k, verdict % (k + 2))
        tokens: list[int] = []
        for _ in range(accepted + 1):  # the accepted draft tokens, then the target's own token
            tokens.append(self._next(req, tokens))
        return self._emit(req, tokens, k=(k, accepted))

    def _next(self, req: _Request, extra: list[int] = ()) -> int:
        history = req.prompt + req.output + list(extra)
        if req.canned:
            at = len(history) - len(req.prompt)
            return req.canned[at] if at < len(req.canned) else EOS
        allow_eos = not req.params.ignore_eos
        if req.params.temperature == 0:
            return greedy_next(history, allow_eos)
        seeded = random.Random(zlib.crc32(repr((req.params.seed, len(history))).encode())) \
            if req.params.seed is not None else req.rng
        return LETTERS[seeded.randrange(len(LETTERS))]

    def _emit(self, req: _Request, tokens: list[int], k: tuple[int, int] | None) -> RequestOutput:
        if k is not None:
            req.stats.record_round(*k)
        req.stats.target_forwards += 1
        new_ids, reason = [], None
        for t in tokens:
            req.output.append(t)
            new_ids.append(t)
            if t == EOS and not req.params.ignore_eos:
                reason = "stop"
                break
            if len(req.output) >= req.params.max_tokens:
                reason = "length"
                break
        full = self.tokenizer.decode(req.output)
        hits = [at for at in (full.find(s) for s in req.params.stop) if at != -1]
        if hits:
            full, reason = full[: min(hits)], "stop"
        self._grow(req)
        if reason is None:
            # hold back a tail that could still become a stop string
            hold = max((len(s) - 1 for s in req.params.stop), default=0)
            visible = full[: len(full) - hold] if hold else full
            new_text, req.text = visible[len(req.text):], visible
            return self._output(req, new_ids, new_text, False, None)
        new_text, req.text = full[len(req.text):], full
        return self._finish(req, reason, new_ids, new_text)

    def _finish(self, req, reason, new_ids, new_text, error=None) -> RequestOutput:
        self.running.remove(req)
        del self.requests[req.request_id]
        self.cached_prefixes.update(self._block_keys(req.prompt))
        self._free(req)
        return self._output(req, new_ids, new_text, True, reason, error)

    def _output(self, req, new_ids, new_text, finished, reason, error=None) -> RequestOutput:
        return RequestOutput(req.request_id, req.prompt, list(req.output), list(new_ids), req.text,
                             new_text, finished, reason, req.stats, error, num_cached_tokens=req.cached)

    # ------------------------------------------------------------------ blocks
    def _grow(self, req: _Request) -> None:
        need = -(-(len(req.prompt) + len(req.output)) // self.block_size)
        while len(req.blocks) < need:
            req.blocks.append(self.free_blocks.pop())

    def _free(self, req: _Request) -> None:
        self.free_blocks.extend(req.blocks)
        req.blocks = []

    def _block_keys(self, prompt: list[int]) -> list[bytes]:
        bs = self.block_size
        return [repr(prompt[: i + bs]).encode() for i in range(0, len(prompt) - bs + 1, bs)]

    def _count_prefix(self, prompt: list[int]) -> int:
        """Count the lookup; returns the prompt tokens found (whole cached blocks)."""
        self.prefix_query_tokens += len(prompt)
        hit = 0
        for key in self._block_keys(prompt):
            if key not in self.cached_prefixes:
                break
            hit += self.block_size
        self.prefix_hit_tokens += hit
        return hit


def main(argv: list[str] | None = None) -> int:
    """Serve a FakeEngine over HTTP with the real server (the HTTP tests' subprocess)."""
    from verispec.server.app import add_arguments, serve

    parser = argparse.ArgumentParser(description="verispec server on the fake engine (tests only)")
    add_arguments(parser)
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds slept per step")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--hang-seconds", type=float, default=20.0, help="how long HANG_STEP sleeps")
    parser.add_argument("--costly-tokenizer", action="store_true",
                        help="tokenize at the real tokenizer's cost (CostlyByteTokenizer)")
    args = parser.parse_args(argv)
    import functools
    return serve(functools.partial(FakeEngine, step_delay_s=args.step_delay, max_num_seqs=args.max_num_seqs,
                                   max_model_len=args.max_model_len, hang_s=args.hang_seconds,
                                   costly_tokenizer=args.costly_tokenizer), args)


if __name__ == "__main__":
    sys.exit(main())
