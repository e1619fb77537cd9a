"""Parser events -> Anthropic Messages SSE events (``event:`` + ``data:`` lines) and bodies.

Sequence (what Claude Code 2.1.197 accepted; ``docs/claude-code.md``):
message_start, content_block_start, ping (once, after the first block start),
content_block_delta*, content_block_stop, ..., message_delta (stop_reason, usage), message_stop.
Thinking blocks start with ``{"thinking":"","signature":""}`` and end with one
``signature_delta`` (the ledger handle); tool_use blocks start with ``input: {}`` and carry the
arguments as ``input_json_delta``s as the parser streams them (Claude Code ignores input given
in the start event); a call cut by max_tokens is closed as it stands (``stop_reason:
max_tokens`` tells the client).
Usage: ``input_tokens`` = prompt - cached, ``cache_read_input_tokens`` = cached.
With ``show_reasoning`` False (``thinking.display`` "omitted"/"updates") a thinking block still
opens and ends with its signature, but carries no ``thinking_delta``.
"""

from __future__ import annotations

from typing import Any

import orjson

from protocol.parser import REASONING, TEXT, TOOL, TOOL_ARGS, TOOL_START, Event

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "stop_sequence": "stop_sequence"}

_PING = b'event: ping\ndata: {"type":"ping"}\n\n'
_STOP_BLOCK = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":%d}\n\n'
_DELTA_HEAD = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
               b'"delta":{"type":"%s","%s":')
_DELTA_TAIL = b"}}\n\n"


def _event(name: bytes, payload: dict[str, Any]) -> bytes:
    return b"event: " + name + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def anthropic_usage(num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> dict[str, int]:
    cached = max(0, min(num_cached_tokens, num_prompt_tokens))
    return {
        "input_tokens": num_prompt_tokens - cached,
        "output_tokens": num_output_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


class AnthropicEmitter:
    """Streaming state: which block is open and its index. Not thread-safe."""

    __slots__ = ("message_id", "model", "signature", "show_reasoning", "_open", "_index", "_pinged")

    def __init__(self, message_id: str, model: str, signature: str, show_reasoning: bool = True) -> None:
        self.message_id = message_id
        self.model = model
        self.signature = signature
        self.show_reasoning = show_reasoning
        self._open: int = -1  # REASONING / TEXT / TOOL_START while a block is open, else -1
        self._index = -1
        self._pinged = False

    def start(self, num_prompt_tokens: int, num_cached_tokens: int) -> bytes:
        usage = anthropic_usage(num_prompt_tokens, num_cached_tokens, 0)
        usage["output_tokens"] = 1
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return _event(b"message_start", {"type": "message_start", "message": message})

    def _close(self, out: list[bytes]) -> None:
        if self._open == REASONING:
            out.append(_DELTA_HEAD % (self._index, b"signature_delta", b"signature")
                       + orjson.dumps(self.signature) + _DELTA_TAIL)
        if self._open != -1:
            out.append(_STOP_BLOCK % self._index)
            self._open = -1

    def _begin(self, out: list[bytes], block: dict[str, Any]) -> None:
        self._index += 1
        out.append(_event(b"content_block_start",
                          {"type": "content_block_start", "index": self._index, "content_block": block}))
        if not self._pinged:
            self._pinged = True
            out.append(_PING)

    def emit(self, events: list[Event], call_ids: list[str]) -> bytes:
        out: list[bytes] = []
        for kind, payload in events:
            if kind == TEXT:
                if self._open != TEXT:
                    self._close(out)
                    self._begin(out, {"type": "text", "text": ""})
                    self._open = TEXT
                out.append(_DELTA_HEAD % (self._index, b"text_delta", b"text") + orjson.dumps(payload)
                           + _DELTA_TAIL)
            elif kind == REASONING:
                if self._open != REASONING:
                    self._close(out)
                    self._begin(out, {"type": "thinking", "thinking": "", "signature": ""})
                    self._open = REASONING
                if self.show_reasoning:
                    out.append(_DELTA_HEAD % (self._index, b"thinking_delta", b"thinking")
                               + orjson.dumps(payload) + _DELTA_TAIL)
            elif kind == TOOL_START:
                index, name = payload
                self._close(out)
                self._begin(out, {"type": "tool_use", "id": call_ids[index], "name": name, "input": {}})
                self._open = TOOL_START
            elif kind == TOOL_ARGS:
                out.append(_DELTA_HEAD % (self._index, b"input_json_delta", b"partial_json")
                           + orjson.dumps(payload) + _DELTA_TAIL)
            elif kind == TOOL:
                self._close(out)
        return b"".join(out)

    def finish(self, stop_reason: str, stop_sequence: str | None, usage: dict[str, int]) -> bytes:
        out: list[bytes] = []
        self._close(out)
        out.append(
            _event(
                b"message_delta",
                {"type": "message_delta",
                 "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": usage},
            )
        )
        out.append(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
        return b"".join(out)


def anthropic_body(
    message_id: str,
    model: str,
    reasoning: str | None,
    signature: str,
    blocks: list[Event],
    call_ids: list[str],
    stop_reason: str,
    stop_sequence: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    """Non-streaming message. ``blocks`` is the ordered list of (TEXT, str) / (TOOL, call);
    ``reasoning`` None means no thinking block."""
    content: list[dict[str, Any]] = []
    if reasoning is not None:
        content.append({"type": "thinking", "thinking": reasoning, "signature": signature})
    for kind, payload in blocks:
        if kind == TEXT:
            content.append({"type": "text", "text": payload})
        else:
            content.append({"type": "tool_use", "id": call_ids[payload.index], "name": payload.name,
                            "input": payload.arguments})
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }
