"""Evidence records: the declared, versioned schema of one measured request, validated on write.

A record that does not match the schema raises `SchemaError` naming the field; the writer never
stores it, so a run cannot silently produce rows whose columns mean something else (the
post-mortem's CSV with 14 headers and 10 values). Field semantics:

  times         seconds, `time.perf_counter()` deltas from the moment the request was sent
  ttft_s        first chunk that carried >= 1 completion token (or non-empty text if the server
                gives no per-chunk counts), see `ttft_basis`
  chunk_*       one entry per streamed SSE chunk that carried output (text or tokens)
  chunk_tokens  completion tokens in that chunk, per `chunk_token_semantics`:
                "usage_delta"        difference of cumulative usage.completion_tokens
                "server_chunk_count" a per-chunk token count the server sent (token_ids)
                "unavailable"        the server gave neither: entries are null
  decode_tokens_per_s  (completion_tokens - first_chunk_tokens) / (last_token_chunk - ttft):
                the tokens that arrived after the first token chunk over the time they took;
                null when per-chunk counts are unavailable (never estimated from words)
  tpot_s        (e2e_s - ttft_s) / (completion_tokens - 1), the vLLM benchmark convention
  itl_s         gaps between consecutive token-carrying chunks (a chunk of 3 tokens is one gap:
                with speculation a chunk holds every token one verify step accepted)
  spec          the server's per-response speculation stats, verbatim (verispec adds "spec")
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REQUEST_SCHEMA = "verispec.bench.request/v1"
RUN_SCHEMA = "verispec.bench.run/v1"

CHUNK_SEMANTICS = ("usage_delta", "server_chunk_count", "unavailable")
TTFT_BASIS = ("first_token_chunk", "first_text_chunk", "no_output")
ERROR_KINDS = ("http_status", "transport", "timeout", "missing_usage", "stream_truncated",
               "no_finish_reason", "bad_chunk", "previous_turn_failed", "usage_mismatch")


class SchemaError(ValueError):
    """A record does not match its declared schema; the message names the field."""


@dataclass(frozen=True)
class Field:
    """One schema field: accepted JSON types, whether it may be null, and an extra check."""

    types: tuple[type, ...]
    nullable: bool = False
    check: Callable[[Any], str | None] | None = None  # returns an error text or None
    items: tuple[type, ...] | None = None             # element types for lists
    items_nullable: bool = False


def _nonneg(v) -> str | None:
    return None if v >= 0 else f"must be >= 0, got {v!r}"


def _positive(v) -> str | None:
    return None if v >= 1 else f"must be >= 1, got {v!r}"


def _nonempty(v) -> str | None:
    return None if v else "must be non-empty"


def _one_of(allowed: tuple[str, ...]) -> Callable[[Any], str | None]:
    return lambda v: None if v in allowed else f"must be one of {list(allowed)}, got {v!r}"


def _all_nonneg(v) -> str | None:
    bad = [x for x in v if x is not None and x < 0]
    return f"entries must be >= 0, got {bad[:3]}" if bad else None


_NUM = (int, float)
REQUEST_FIELDS: dict[str, Field] = {
    "schema": Field((str,), check=_one_of((REQUEST_SCHEMA,))),
    "run_id": Field((str,), check=_nonempty),
    "config_name": Field((str,), check=_nonempty),
    "pass_index": Field((int,), check=_nonneg),
    "order_index": Field((int,), check=_nonneg),
    "dataset": Field((str,), check=_nonempty),
    "prompt_id": Field((str,), check=_nonempty),
    "source_id": Field((str,), check=_nonempty),
    "task": Field((str,), nullable=True),
    "turn": Field((int,), check=_nonneg),
    "num_turns": Field((int,), check=_positive),
    "model": Field((str,), check=_nonempty),
    "temperature": Field(_NUM, check=_nonneg),
    "max_tokens": Field((int,), check=_positive),
    "request_seed": Field((int,), nullable=True),
    "status": Field((str,), check=_one_of(("ok", "error"))),
    "error": Field((dict,), nullable=True),
    "http_status": Field((int,), nullable=True),
    "request_start_unix": Field(_NUM),
    "prompt_tokens": Field((int,), nullable=True, check=_nonneg),
    "completion_tokens": Field((int,), nullable=True, check=_nonneg),
    "ttft_s": Field(_NUM, nullable=True, check=_nonneg),
    "ttft_basis": Field((str,), nullable=True, check=_one_of(TTFT_BASIS)),
    "e2e_s": Field(_NUM, nullable=True, check=_nonneg),
    "tpot_s": Field(_NUM, nullable=True, check=_nonneg),
    "first_chunk_tokens": Field((int,), nullable=True, check=_nonneg),
    "decode_tokens_per_s": Field(_NUM, nullable=True, check=_nonneg),
    "chunk_times_s": Field((list,), items=_NUM, check=_all_nonneg),
    "chunk_tokens": Field((list,), items=(int,), items_nullable=True, check=_all_nonneg),
    "chunk_chars": Field((list,), items=(int,), check=_all_nonneg),
    "chunk_token_semantics": Field((str,), check=_one_of(CHUNK_SEMANTICS)),
    "itl_s": Field((list,), items=_NUM, check=_all_nonneg),
    "output_text": Field((str,), nullable=True),
    "finish_reason": Field((str,), nullable=True),
    "stream_done": Field((bool,)),
    "spec": Field((dict,), nullable=True),
    "json_valid": Field((bool,), nullable=True),
    "flags": Field((list,), items=(str,)),
}

# Fields that must be non-null when status == "ok": a completed request without exact usage
# counts or timings is not evidence, so it cannot be written as one.
REQUIRED_WHEN_OK = ("prompt_tokens", "completion_tokens", "ttft_s", "ttft_basis", "e2e_s",
                    "output_text", "finish_reason")
ERROR_FIELDS = {"kind": (str,), "message": (str,), "http_status": (int, type(None)),
                "body": (str, type(None))}


def _type_ok(value, types: tuple[type, ...]) -> bool:
    # bool is an int subclass in Python; a True where a count belongs is a bug, not a count.
    if isinstance(value, bool) and bool not in types:
        return False
    return isinstance(value, types)


def _check_field(name: str, spec: Field, value) -> None:
    if value is None:
        if not spec.nullable:
            raise SchemaError(f"field {name!r} must not be null")
        return
    if not _type_ok(value, spec.types):
        raise SchemaError(f"field {name!r} must be {[t.__name__ for t in spec.types]}, "
                          f"got {type(value).__name__} {value!r:.80}")
    if spec.items is not None:
        for i, item in enumerate(value):
            if item is None and spec.items_nullable:
                continue
            if not _type_ok(item, spec.items):
                raise SchemaError(f"field {name!r}[{i}] must be "
                                  f"{[t.__name__ for t in spec.items]}, got {item!r:.40}")
    if spec.check is not None:
        problem = spec.check(value)
        if problem:
            raise SchemaError(f"field {name!r} {problem}")


def validate_request_record(record: dict) -> None:
    """Raise SchemaError (naming the field) unless `record` matches verispec.bench.request/v1."""
    if not isinstance(record, dict):
        raise SchemaError(f"record must be a JSON object, got {type(record).__name__}")
    missing = [k for k in REQUEST_FIELDS if k not in record]
    if missing:
        raise SchemaError(f"field {missing[0]!r} is missing (all missing: {missing})")
    unknown = sorted(set(record) - set(REQUEST_FIELDS))
    if unknown:
        raise SchemaError(f"field {unknown[0]!r} is not in schema {REQUEST_SCHEMA}")
    for name, spec in REQUEST_FIELDS.items():
        _check_field(name, spec, record[name])
    _check_consistency(record)


def _check_consistency(r: dict) -> None:
    n = len(r["chunk_times_s"])
    for name in ("chunk_tokens", "chunk_chars"):
        if len(r[name]) != n:
            raise SchemaError(f"field {name!r} has {len(r[name])} entries but chunk_times_s has {n}")
    if r["turn"] >= r["num_turns"]:
        raise SchemaError(f"field 'turn' must be < num_turns={r['num_turns']}, got {r['turn']}")
    if r["status"] == "ok":
        for name in REQUIRED_WHEN_OK:
            if r[name] is None:
                raise SchemaError(f"field {name!r} must not be null when status is 'ok'")
        if r["error"] is not None:
            raise SchemaError("field 'error' must be null when status is 'ok'")
        known = [t for t in r["chunk_tokens"] if t is not None]
        if r["chunk_token_semantics"] != "unavailable" and len(known) != n:
            raise SchemaError("field 'chunk_tokens' has null entries but chunk_token_semantics "
                              f"is {r['chunk_token_semantics']!r}")
        if known and len(known) == n and sum(known) != r["completion_tokens"]:
            raise SchemaError(f"field 'chunk_tokens' sums to {sum(known)} but completion_tokens "
                              f"is {r['completion_tokens']}")
    else:
        _check_error_object(r["error"])


def _check_error_object(err) -> None:
    if not isinstance(err, dict):
        raise SchemaError("field 'error' must be an object when status is 'error'")
    for key, types in ERROR_FIELDS.items():
        if key not in err:
            raise SchemaError(f"field 'error.{key}' is missing")
        if not _type_ok(err[key], types):
            raise SchemaError(f"field 'error.{key}' has the wrong type: {err[key]!r:.80}")
    if err["kind"] not in ERROR_KINDS:
        raise SchemaError(f"field 'error.kind' must be one of {list(ERROR_KINDS)}, "
                          f"got {err['kind']!r}")


class RecordWriter:
    """Append-only JSONL writer that validates every record before it touches the file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("w", encoding="utf-8")
        self.count = 0

    def write(self, record: dict) -> None:
        """Validate `record` and append it; raises SchemaError and writes nothing if invalid."""
        validate_request_record(record)
        self._fh.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_records(path: Path) -> list[dict]:
    """Load and re-validate a records.jsonl file (a stored result is checked on read too)."""
    out = []
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            try:
                validate_request_record(record)
            except SchemaError as e:
                raise SchemaError(f"{path}:{lineno}: {e}") from None
            out.append(record)
    return out


def request_key(record: dict) -> tuple[str, str, int]:
    """The identity of one measured prompt turn across runs: (dataset, prompt_id, turn)."""
    return (record["dataset"], record["prompt_id"], record["turn"])


RUN_FIELDS = {
    "schema": str, "run_id": str, "config_name": str, "status": str, "started_unix": float,
    "finished_unix": float, "config": dict, "api_key_set": bool, "model": str,
    "server_models": list, "versions": dict, "git": dict, "machine": dict, "datasets": list,
    "selection": dict, "warmup": dict, "counts": dict, "missing": list, "errors": list,
    "pass_wall_s": list, "metrics": dict,
}


def validate_run_manifest(manifest: dict) -> None:
    """Raise SchemaError (naming the field) unless `manifest` matches verispec.bench.run/v1."""
    for name, typ in RUN_FIELDS.items():
        if name not in manifest:
            raise SchemaError(f"run field {name!r} is missing")
        value = manifest[name]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) if typ is float \
            else isinstance(value, typ)
        if not ok:
            raise SchemaError(f"run field {name!r} must be {typ.__name__}, got {value!r:.80}")
    if manifest["schema"] != RUN_SCHEMA:
        raise SchemaError(f"run field 'schema' must be {RUN_SCHEMA!r}, got {manifest['schema']!r}")
    if manifest["status"] not in ("complete", "incomplete"):
        raise SchemaError(f"run field 'status' must be 'complete' or 'incomplete'")
    counts = manifest["counts"]
    for key in ("expected", "completed", "failed", "records"):
        if not isinstance(counts.get(key), int):
            raise SchemaError(f"run field 'counts.{key}' must be an integer")
    complete = counts["completed"] == counts["expected"] and not manifest["missing"]
    if (manifest["status"] == "complete") != complete:
        raise SchemaError(f"run field 'status' is {manifest['status']!r} but "
                          f"{counts['completed']}/{counts['expected']} requests completed")


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """Load run.json and records.jsonl of a run directory, both validated."""
    run_dir = Path(run_dir)
    manifest = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    validate_run_manifest(manifest)
    return manifest, read_records(run_dir / "records.jsonl")
