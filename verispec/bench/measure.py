"""Turn one request's raw stream evidence into a schema record (timings, tokens per chunk).

Pure functions over `StreamResult`; no I/O, so every derived number can be unit-tested.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from verispec.bench.client import ChunkEvent, StreamResult
from verispec.bench.datasets import TASK_JSON
from verispec.bench.records import REQUEST_SCHEMA


@dataclass(frozen=True)
class RequestContext:
    """Who a request was: run, pass, prompt, turn and the sampling it asked for."""

    run_id: str
    config_name: str
    pass_index: int
    order_index: int
    dataset: str
    prompt_id: str
    source_id: str
    task: str | None
    turn: int
    num_turns: int
    model: str
    temperature: float
    max_tokens: int
    request_seed: int | None


@dataclass(frozen=True)
class ChunkTokens:
    """Completion tokens per output chunk and where the numbers came from."""

    events: list[ChunkEvent]       # chunks that carried text or tokens
    tokens: list[int | None]
    semantics: str
    flags: tuple[str, ...] = ()


def chunk_tokens(result: StreamResult) -> ChunkTokens:
    """Per-chunk completion tokens from cumulative usage, else the server's count, else None."""
    total = (result.usage or {}).get("completion_tokens")
    if result.events and all(e.usage_completion_tokens is not None
                             for e in result.events if e.has_choice):
        deltas, prev = [], 0
        for e in result.events:
            cum = e.usage_completion_tokens if e.usage_completion_tokens is not None else prev
            deltas.append(cum - prev)
            prev = cum
        kept = [(e, d) for e, d in zip(result.events, deltas) if e.has_choice and (d or e.text)]
        counted = _consistent(kept, total, "usage_delta")
        if counted:
            return counted
        return _unavailable(result, ("chunk_usage_inconsistent",))
    counted_events = [e for e in result.events if e.has_choice and (e.text or e.token_count)]
    if counted_events and all(e.token_count is not None for e in counted_events):
        counted = _consistent([(e, e.token_count) for e in counted_events], total,
                              "server_chunk_count")
        if counted:
            return counted
        return _unavailable(result, ("chunk_count_inconsistent",))
    return _unavailable(result, ())


def _consistent(kept, total, semantics: str) -> ChunkTokens | None:
    # Negative deltas (a counter going backwards) or a sum that disagrees with the final usage
    # mean the per-chunk numbers cannot be trusted; the caller then records them as unavailable.
    if any(d < 0 for _, d in kept) or sum(d for _, d in kept) != total:
        return None
    return ChunkTokens([e for e, _ in kept], [d for _, d in kept], semantics)


def _unavailable(result: StreamResult, flags: tuple[str, ...]) -> ChunkTokens:
    events = [e for e in result.events if e.has_choice and e.text]
    return ChunkTokens(events, [None] * len(events), "unavailable", flags)


def json_valid(text: str) -> bool:
    """True if `text` (optionally inside one ``` fence) parses as a JSON object or array."""
    body = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*\n?(.*?)\n?```", body, flags=re.S)
    if fenced:
        body = fenced.group(1).strip()
    try:
        return isinstance(json.loads(body), (dict, list))
    except ValueError:
        return False


def timings(ct: ChunkTokens, completion_tokens: int | None, e2e_s: float) -> dict:
    """TTFT, TPOT, decode rate and inter-token gaps from the output chunks."""
    known = ct.semantics != "unavailable"
    token_events = [(e, n) for e, n in zip(ct.events, ct.tokens) if (n or 0) > 0 or not known]
    out = {"ttft_s": None, "ttft_basis": None, "tpot_s": None, "first_chunk_tokens": None,
           "decode_tokens_per_s": None, "itl_s": [], "flags": []}
    if not token_events:
        out.update(ttft_s=e2e_s, ttft_basis="no_output")
        out["flags"].append("empty_output")
        return out
    first, first_n = token_events[0]
    out["ttft_s"] = first.t
    out["ttft_basis"] = "first_token_chunk" if known else "first_text_chunk"
    out["itl_s"] = [b.t - a.t for (a, _), (b, _) in zip(token_events, token_events[1:])]
    if completion_tokens is not None and completion_tokens > 1:
        out["tpot_s"] = (e2e_s - first.t) / (completion_tokens - 1)
    if known:
        out["first_chunk_tokens"] = first_n
        after_first = (completion_tokens or 0) - first_n
        span = token_events[-1][0].t - first.t
        if after_first > 0 and span > 0:
            out["decode_tokens_per_s"] = after_first / span
        else:
            out["flags"].append("decode_rate_undefined_single_chunk")
    else:
        out["flags"].append("decode_rate_unavailable_no_chunk_counts")
    return out


def build_record(ctx: RequestContext, result: StreamResult) -> dict:
    """The verispec.bench.request/v1 record for one finished (or failed) request."""
    usage = result.usage or {}
    ok = result.error is None
    ct = chunk_tokens(result)
    completion = usage.get("completion_tokens") if ok else _int_or_none(usage.get("completion_tokens"))
    t = timings(ct, completion, result.e2e_s or 0.0)
    text = result.text
    flags = list(ct.flags) + t.pop("flags")
    record = {
        "schema": REQUEST_SCHEMA, "run_id": ctx.run_id, "config_name": ctx.config_name,
        "pass_index": ctx.pass_index, "order_index": ctx.order_index, "dataset": ctx.dataset,
        "prompt_id": ctx.prompt_id, "source_id": ctx.source_id, "task": ctx.task,
        "turn": ctx.turn, "num_turns": ctx.num_turns, "model": ctx.model,
        "temperature": ctx.temperature, "max_tokens": ctx.max_tokens,
        "request_seed": ctx.request_seed, "status": "ok" if ok else "error",
        "error": None if ok else result.error.to_dict(), "http_status": result.http_status,
        "request_start_unix": result.start_unix,
        "prompt_tokens": _int_or_none(usage.get("prompt_tokens")),
        "completion_tokens": completion, "e2e_s": result.e2e_s,
        "chunk_times_s": [e.t for e in ct.events], "chunk_tokens": ct.tokens,
        "chunk_chars": [len(e.text) for e in ct.events], "chunk_token_semantics": ct.semantics,
        "output_text": text if (ok or text) else None, "finish_reason": result.finish_reason,
        "stream_done": result.saw_done, "spec": result.spec,
        "json_valid": json_valid(text) if ctx.task == TASK_JSON and ok else None,
        "flags": flags, **t,
    }
    if not ok:
        # A failed request's partial timings are kept as evidence but must not look measured.
        record.update(tpot_s=None, decode_tokens_per_s=None)
    return record


def _int_or_none(v):
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
