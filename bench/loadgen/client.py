"""Streams one ``/v1/messages`` request and measures it (httpx async, Anthropic SSE).

TTFT is the time from sending the request to the first content delta (``thinking_delta``,
``text_delta`` or a non-empty ``input_json_delta``; a ``tool_use`` block start counts too). Stream
speed is (output tokens - 1) / (last delta - first delta). Input tokens are
``input_tokens + cache_read_input_tokens + cache_creation_input_tokens`` of the final usage, the
cached share is ``cache_read_input_tokens``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson


@dataclass(slots=True)
class RequestRecord:
    """One request as the agent saw it; times are ``time.monotonic()`` seconds."""

    agent_id: int
    session_id: str
    t_start: float
    t_end: float = 0.0
    ttft_s: float | None = None
    decode_s: float = 0.0
    output_tokens: int = 0
    input_tokens: int = 0  # uncached input tokens (usage.input_tokens)
    cached_tokens: int = 0  # usage.cache_read_input_tokens
    creation_tokens: int = 0  # usage.cache_creation_input_tokens
    status: int = 0
    error: str | None = None
    stop_reason: str | None = None
    cold: bool = False  # first request of a conversation
    context_tokens_sent: int = 0  # the agent's own estimate before sending
    subagent_id: str | None = None  # the x-claude-code-agent-id it was sent with (a subagent's request)
    blocks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total_input_tokens(self) -> int:
        return self.input_tokens + self.cached_tokens + self.creation_tokens

    @property
    def tokens_per_s(self) -> float | None:
        if self.output_tokens < 2 or self.decode_s <= 0:
            return None
        return (self.output_tokens - 1) / self.decode_s

    def summary(self) -> dict[str, Any]:
        return {
            "agent": self.agent_id,
            "t_start": round(self.t_start, 4),
            "t_end": round(self.t_end, 4),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
            "tok_s": None if self.tokens_per_s is None else round(self.tokens_per_s, 2),
            "out": self.output_tokens,
            "in": self.total_input_tokens,
            "cached": self.cached_tokens,
            "status": self.status,
            "error": self.error,
            "cold": self.cold,
        }


class _StreamState:
    """Assembles content blocks from SSE events."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, Any]] = {}
        self.json_parts: dict[int, list[str]] = {}
        self.usage: dict[str, int] = {}
        self.stop_reason: str | None = None
        self.error: str | None = None
        self.done = False

    def handle(self, event: str, data: dict[str, Any]) -> bool:
        """Apply one event; returns True if it carried model output (for TTFT/speed)."""
        kind = data.get("type", event)
        if kind == "message_start":
            self._usage(data.get("message", {}).get("usage"))
        elif kind == "content_block_start":
            block = dict(data.get("content_block") or {})
            self.blocks[int(data.get("index", len(self.blocks)))] = block
            return block.get("type") == "tool_use"
        elif kind == "content_block_delta":
            idx = int(data.get("index", 0))
            delta = data.get("delta") or {}
            block = self.blocks.setdefault(idx, {"type": "text", "text": ""})
            dtype = delta.get("type")
            if dtype == "text_delta":
                block["text"] = block.get("text", "") + delta.get("text", "")
                return bool(delta.get("text"))
            if dtype == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
                return bool(delta.get("thinking"))
            if dtype == "signature_delta":
                block["signature"] = block.get("signature", "") + delta.get("signature", "")
            elif dtype == "input_json_delta":
                part = delta.get("partial_json", "")
                self.json_parts.setdefault(idx, []).append(part)
                return bool(part)
        elif kind == "content_block_stop":
            idx = int(data.get("index", 0))
            block = self.blocks.get(idx)
            if block is not None and block.get("type") == "tool_use":
                raw = "".join(self.json_parts.get(idx, []))
                try:
                    block["input"] = orjson.loads(raw) if raw else block.get("input", {})
                except orjson.JSONDecodeError:
                    block["input"] = {"_raw": raw}
        elif kind == "message_delta":
            self.stop_reason = (data.get("delta") or {}).get("stop_reason", self.stop_reason)
            self._usage(data.get("usage"))
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            err = data.get("error") or {}
            self.error = f"{err.get('type', 'error')}: {err.get('message', '')}"[:300]
        return False

    def _usage(self, usage: dict[str, Any] | None) -> None:
        for key, value in (usage or {}).items():
            if isinstance(value, int):
                self.usage[key] = value

    def ordered_blocks(self) -> list[dict[str, Any]]:
        return [self.blocks[i] for i in sorted(self.blocks)]


async def stream_message(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    record: RequestRecord,
    timeout_s: float = 1800.0,
) -> RequestRecord:
    """Send one streaming request; fill ``record`` (never raises for HTTP or transport errors)."""
    state = _StreamState()
    t0 = record.t_start = time.monotonic()
    t_first: float | None = None
    t_last: float | None = None
    event = ""
    try:
        async with client.stream("POST", url, content=body, headers=headers, timeout=timeout_s) as resp:
            record.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {resp.status_code}: {text[:300]}"
                return record
            async for line in resp.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    payload = line[5:].strip()
                    if not payload or payload == "[DONE]":
                        continue
                    data = orjson.loads(payload)
                    if state.handle(event, data):
                        now = time.monotonic()
                        if t_first is None:
                            t_first = now
                        t_last = now
        if state.error:
            record.error = state.error
        elif not state.done:
            record.error = "stream ended without message_stop"
    except (httpx.HTTPError, orjson.JSONDecodeError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        record.t_end = time.monotonic()
    if t_first is not None:
        record.ttft_s = t_first - t0
        record.decode_s = (t_last or t_first) - t_first
    usage = state.usage
    record.input_tokens = usage.get("input_tokens", 0)
    record.cached_tokens = usage.get("cache_read_input_tokens", 0)
    record.creation_tokens = usage.get("cache_creation_input_tokens", 0)
    record.output_tokens = usage.get("output_tokens", 0)
    record.stop_reason = state.stop_reason
    record.blocks = state.ordered_blocks()
    if record.error is None and t_first is None and record.output_tokens > 0:
        record.ttft_s = record.t_end - t0  # output arrived only as usage (e.g. empty text)
    return record
