"""Tool calls in a model's output: Hermes/Qwen-style blocks to OpenAI's `tool_calls` shape.

Models whose chat template renders `tools` (Qwen2.5, Hermes, ...) answer a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallParser` turns a growing output text into events, ("text", str) for text outside
the blocks and ("call", {...}) for each complete, valid block, in one pass that a stream
feeds piece by piece: text that may be the start of `<tool_call>` is held back until it is
decided, and a block is emitted when its `</tool_call>` arrives. Whatever the split of the
text into pieces, the events concatenate to the same result (parse_tool_calls is the same
parser fed the whole text at once).

Rules: a block whose inside is not a JSON object with a string "name" (and "arguments" an
object, a string, or absent) is left in the text as it was written; a block still open
when the text ends counts if its inside is such an object (a model may stop on EOS before
writing `</tool_call>`), otherwise it is text. Whitespace between blocks, around them and
(after a call) at the end of the text is dropped; text without a valid block comes out
exactly as written. Pure Python: no server imports.
"""
from __future__ import annotations

import json
import secrets
from typing import Any

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


def call_grammar(tools: list[dict], parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are one `<tool_call>` block per
    call, or several separated by newlines when `parallel`: each block's inside is a JSON
    object {"name": one of the tools, "arguments": valid against that tool's parameters}.
    `tools` are OpenAI tool definitions as dicts."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object"}}}
             for t in tools]
    block = f'"{TOOL_OPEN}\\n" %json {json.dumps({"anyOf": calls})} "\\n{TOOL_CLOSE}"'
    repeat = ' ("\\n" call)*' if parallel else ""
    return f"start: call{repeat}\ncall: {block}"


def new_call_id() -> str:
    """An OpenAI-style tool call id: "call_" + 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def call_from_block(inner: str) -> dict | None:
    """The OpenAI tool call of a block's inside, or None if it is not a valid call."""
    try:
        data = json.loads(inner)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, dict):
        arguments = json.dumps(args, ensure_ascii=False)
    elif isinstance(args, str):
        arguments = args
    else:
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": data["name"], "arguments": arguments}}


class ToolCallParser:
    """Incremental parser of `<tool_call>` blocks; feed() text pieces, then finish()."""

    def __init__(self):
        self._buffer = ""         # text not yet decided
        self._pending_ws = ""     # trailing whitespace of emitted text, held until more text
        self._after_block = False  # drop whitespace right after a block
        self.num_calls = 0

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buffer += text
        events: list[tuple[str, Any]] = []
        while True:
            start = self._buffer.find(TOOL_OPEN)
            if start == -1:
                keep = _partial_prefix_len(self._buffer, TOOL_OPEN)
                self._text(self._buffer[:len(self._buffer) - keep], events)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return events
            self._text(self._buffer[:start], events)
            self._buffer = self._buffer[start:]
            end = self._buffer.find(TOOL_CLOSE, len(TOOL_OPEN))
            if end == -1:
                return events  # the block is still open: wait for its end
            block = self._buffer[:end + len(TOOL_CLOSE)]
            self._buffer = self._buffer[end + len(TOOL_CLOSE):]
            self._block(block, block[len(TOOL_OPEN):end], events)

    def finish(self) -> list[tuple[str, Any]]:
        """The events of what is left when the text ends."""
        events: list[tuple[str, Any]] = []
        rest, self._buffer = self._buffer, ""
        if rest.startswith(TOOL_OPEN):
            self._block(rest, rest[len(TOOL_OPEN):], events)
        else:
            self._text(rest, events)
        if self._pending_ws and not self.num_calls:  # no call: the text exactly as written
            events.append(("text", self._pending_ws))
        self._pending_ws = ""  # after a call, whitespace at the end of the text is dropped
        return events

    def _block(self, block: str, inner: str, events: list) -> None:
        call = call_from_block(inner)
        if call is None:  # malformed: the block stays text, as the model wrote it
            self._text(block, events)
            return
        self._pending_ws = ""
        self._after_block = True
        self.num_calls += 1
        events.append(("call", call))

    def _text(self, text: str, events: list) -> None:
        if self._after_block:
            text = text.lstrip()
            if not text:
                return
            self._after_block = False
        full = self._pending_ws + text
        body = full.rstrip()
        self._pending_ws = full[len(body):]
        if body:
            events.append(("text", body))


def _partial_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole output: content is the text outside the blocks
    (None when there is none), the calls in order."""
    parser = ToolCallParser()
    events = parser.feed(text) + parser.finish()
    return collect(events)


def collect(events: list[tuple[str, Any]]) -> tuple[str | None, list[dict]]:
    content = "".join(v for k, v in events if k == "text")
    return content or None, [v for k, v in events if k == "call"]


# ---------------------------------------------------------------------------- the server's use
def apply_to_response(body: dict, parallel_tool_calls: bool = True) -> None:
    """Rewrite a chat.completion body in place: tool calls parsed out of message.content
    into message.tool_calls, finish_reason "tool_calls" when the model stopped after them."""
    choice = body["choices"][0]
    message = choice["message"]
    content, calls = parse_tool_calls(message.get("content") or "")
    if not calls:
        return
    if not parallel_tool_calls:
        calls = calls[:1]
    message["content"] = content
    message["tool_calls"] = calls
    if choice.get("finish_reason") == "stop":
        choice["finish_reason"] = "tool_calls"


async def stream_events(events, parallel_tool_calls: bool = True):
    """Rewrite a chat stream's SSE events (bytes): `delta.content` through ToolCallParser, a
    complete block as one `delta.tool_calls` chunk (index, id, type, function name and
    arguments), finish_reason "tool_calls" when the model stopped after a call."""
    try:
        async for event in _rewrite(events, parallel_tool_calls):
            yield event
    finally:
        await events.aclose()


async def _rewrite(events, parallel_tool_calls: bool):
    parser = ToolCallParser()
    index = 0
    async for event in events:
        payload = event[len(b"data: "):].strip()
        if payload == b"[DONE]":
            yield event
            continue
        obj = json.loads(payload)
        choices = obj.get("choices")
        if not choices:  # the usage chunk, an error
            yield event
            continue
        choice = choices[0]
        delta = choice.get("delta") or {}
        if "role" in delta:  # the first chunk
            yield event
            continue
        finish = choice.get("finish_reason")
        out = parser.feed(delta["content"]) if delta.get("content") else []
        if finish is not None:
            out += parser.finish()
        deltas = []
        for kind, value in out:
            if kind == "text":
                deltas.append({"content": value})
            elif parallel_tool_calls or index == 0:
                deltas.append({"tool_calls": [{"index": index, **value}]})
                index += 1
        if finish == "stop" and index:
            finish = "tool_calls"
        if not deltas:
            if finish is None and not isinstance(obj.get("usage"), dict):
                continue  # everything is held back, and there is no usage to report
            deltas = [{}]
        for i, d in enumerate(deltas):
            last = i == len(deltas) - 1
            chunk = {k: v for k, v in obj.items() if k != "spec" or last}
            chunk["choices"] = [{**choice, "delta": d, "finish_reason": finish if last else None,
                                 "logprobs": choice.get("logprobs") if i == 0 else None}]
            yield b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
