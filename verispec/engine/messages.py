"""The messages between the API front end and the engine core (msgpack, typed by msgspec).

    front end -> core (one message per command)      core -> front end (one per loop turn)
      Add(request_id, prompt, params, spec)             CoreOutputs(events, stats, ...)
      Abort(request_id)                                  events: one RequestEvent per request
      Call(call_id, fn)        fn(engine), pickled               that the turn changed
      Shutdown(reason)                                   calls: CallResult(call_id, ...)

One CoreOutputs carries everything a step produced for the whole batch (not one message
per token), plus the engine's stats after it. msgspec was chosen over pickle by
measurement: encode + decode of a 16-request step message takes ~5 us against ~20 us.
This module imports neither torch nor the server, so both sides can load it.
"""
from __future__ import annotations

import msgspec

from verispec.sampling import SamplingParams

# RequestEvent.kind
ACCEPTED = 0   # the engine queued the request
REJECTED = 1   # the engine refused it: `error` says why (bad_input: a ValueError, HTTP 400)
OUTPUT = 2     # new tokens/text; `finished` ends it; `error` set: it failed on its own
ABORTED = 3    # an Abort (or the shutdown) took effect; `error` set when the shutdown did it
FAILED = 4     # a step raised out of the engine (the last resort) and took this request with it


class SpecFields(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request's speculation override (the server's `speculative` field)."""

    method: str | None = None
    num_tokens: int | None = None
    adaptive: bool | None = None


class Add(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt: list[int]
    params: SamplingParams
    spec: SpecFields | None = None


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class Call(msgspec.Struct, tag=True, array_like=True):
    """Run fn(engine) between two steps; fn is pickled (a module-level function or a partial)."""

    call_id: int
    fn: bytes


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Abort what is left (its streams end with `reason`) and stop the core."""

    reason: str


Command = Add | Abort | Call | Shutdown


class SpecSnapshot(msgspec.Struct, array_like=True):
    """A request's SpecStats (verispec.outputs) when it ends."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    drafted_per_position: list[int]
    target_forwards: int
    by_proposer: dict[str, list[int]]


class RequestEvent(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    kind: int
    new_token_ids: list[int] = []
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    bad_input: bool = False
    spec: SpecSnapshot | None = None   # with the event that ends the request
    num_cached_tokens: int = 0         # prompt tokens the prefix cache served (OUTPUT events)
    # time.monotonic() in the engine process when the request was first scheduled (OUTPUT
    # events; 0: not known). CLOCK_MONOTONIC is one clock for every process on the machine.
    scheduled_at: float = 0.0
    # per new token (logprob, [(token id, logprob), ...]); only for requests that asked
    # (SamplingParams.logprobs), omitted otherwise
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class EngineStats(msgspec.Struct, array_like=True):
    """What LLMEngine.stats() reports (sent after every loop turn of the core)."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_preemptions: int = 0     # since start (the engine's LLMEngine.num_preemptions)
    proposer_stats: dict[str, dict[str, float]] = {}  # method -> its proposer's stats()


class CallResult(msgspec.Struct, array_like=True):
    call_id: int
    ok: bool
    value: bytes   # pickled result, or the pickled exception


class CoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    events: list[RequestEvent] = []
    calls: list[CallResult] = []
    stats: EngineStats | None = None
    step_error: str | None = None        # a request failed in the engine, or a step raised:
                                         # the latest one's text (server log, /health)
    integrity_error: str | None = None   # the idle KV integrity check failed
    integrity_checked: bool = False      # the check ran this turn (passing clears the error)
    closed: bool = False                 # the core's last message: it has stopped
    fatal: str | None = None             # why it stopped, when not by Shutdown
    step_errors: int = 0                 # failures behind step_error this turn (requests failed
                                         # alone, or 1 for a step that raised out of the engine)


class EngineInfo(msgspec.Struct):
    """What the front end learns about the engine when the core is ready."""

    model_name: str
    max_model_len: int
    spec_method: str
    pid: int
    threads: int | None
    config: dict = {}
    sampling_defaults: dict = {}   # the model's generation_config.json sampling values (TokenizerMeta)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def command_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Command)


def outputs_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreOutputs)
