"""Incremental SSE parsing and the end-of-stream rules of both APIs.

A stream of ``/v1/messages`` ends well with ``event: message_stop`` and badly with
``event: error`` (data ``{"type": "error", "error": {...}}``). A stream of
``/v1/chat/completions`` ends well with ``data: [DONE]`` and badly with a chunk that carries
``error`` and no ``choices``. Anything else (EOF after partial output) is a broken stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(slots=True)
class SseEvent:
    event: str | None
    data: Any  # parsed JSON, or the raw text ("[DONE]", or what failed to parse)


class SseParser:
    """Feed bytes as they arrive; get whole events back. Invariant: ``_buf`` never holds a
    complete event (``\\n\\n``) after ``feed`` returns."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[SseEvent]:
        self._buf += data.replace(b"\r\n", b"\n")
        events: list[SseEvent] = []
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                return events
            block, self._buf = self._buf[:end], self._buf[end + 2 :]
            event_name: str | None = None
            data_lines: list[bytes] = []
            for line in block.split(b"\n"):
                if line.startswith(b"event:"):
                    event_name = line[6:].strip().decode("utf-8", "replace")
                elif line.startswith(b"data:"):
                    data_lines.append(line[5:].lstrip(b" "))
            if not data_lines and event_name is None:
                continue  # a comment or keep-alive
            raw = b"\n".join(data_lines)
            try:
                payload: Any = orjson.loads(raw)
            except orjson.JSONDecodeError:
                payload = raw.decode("utf-8", "replace")
            events.append(SseEvent(event_name, payload))

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)


def api_of_path(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def is_error_event(api: str, ev: SseEvent) -> bool:
    """The stream's own error frame, in ``api``'s format."""
    if api == "anthropic":
        return (ev.event == "error" and isinstance(ev.data, dict) and ev.data.get("type") == "error"
                and isinstance(ev.data.get("error"), dict) and bool(ev.data["error"].get("message")))
    return (isinstance(ev.data, dict) and "choices" not in ev.data and isinstance(ev.data.get("error"), dict)
            and bool(ev.data["error"].get("message")) and "type" in ev.data["error"])


def is_done_event(api: str, ev: SseEvent) -> bool:
    if api == "anthropic":
        return ev.event == "message_stop"
    return ev.data == "[DONE]"


def is_content_event(api: str, ev: SseEvent) -> bool:
    """An event that carries generated output (text, thinking or tool input)."""
    if api == "anthropic":
        return ev.event == "content_block_delta"
    if not isinstance(ev.data, dict):
        return False
    for choice in ev.data.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False


def error_body_problem(api: str, status: int, body: bytes) -> str | None:
    """None if ``body`` is a well-formed error of ``api``'s shape with a useful message."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return f"status {status}: body is not JSON: {body[:200]!r}"
    if not isinstance(data, dict):
        return f"status {status}: body is not an object"
    if api == "anthropic":
        err = data.get("error")
        if data.get("type") != "error" or not isinstance(err, dict):
            return f"status {status}: not an Anthropic error body: {data!r:.300}"
        if not isinstance(err.get("type"), str) or not err["type"]:
            return f"status {status}: Anthropic error without a type: {data!r:.300}"
    else:
        err = data.get("error")
        if not isinstance(err, dict) or set(err) < {"message", "type"}:
            return f"status {status}: not an OpenAI error body: {data!r:.300}"
        if "param" not in err or "code" not in err:
            return f"status {status}: OpenAI error lacks param/code: {data!r:.300}"
    message = err.get("message")
    if not isinstance(message, str) or len(message.strip()) < 8:
        return f"status {status}: error message says nothing: {data!r:.300}"
    if message.startswith("internal server error"):  # also "... (request id X)"
        return f"status {status}: generic internal error: {data!r:.300}"
    return None
