"""Helpers for the protocol tests that drive a ResponseStream and read its SSE frames back."""

from __future__ import annotations

from typing import Any

import orjson

from protocol.api import Protocol
from protocol.tokenize import PromptTokenizer

MODEL = "deepseek-v4.1-flash"
D = "｜DSML｜"
EOS = "<｜end▁of▁sentence｜>"
TOOL_OUT = ("The user wants the README.</think>I'll read it." f"\n\n<{D} calls>\n<{D} invoke name=\"Read\">\n"
            f"<{D} parameter name=\"file_path\" string=\"true\">/p/README.md</{D} parameter>\n</{D} "
            f"invoke>\n</{D} calls>{EOS}")


def claude_code_request(num_tools: int = 24) -> dict[str, Any]:
    tools = [
        {
            "name": f"Tool{k}" if k else "Read",
            "description": "Reads a file from the local filesystem. " * 5,
            "input_schema": {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "type": "object",
                "properties": {"file_path": {"type": "string"},
                               "limit": {"type": "integer", "maximum": 9007199254740991}},
                "required": ["file_path"],
                "additionalProperties": False,
            },
        }
        for k in range(num_tools)
    ]
    return {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": [
                {"type": "text",
                 "text": "<system-reminder>\nToday's date is 2026-11-29.\n</system-reminder>\n\n"},
                {"type": "text", "text": "What is in README.md?", "cache_control": {"type": "ephemeral"}},
            ]},
            {"role": "system", "content": "Available agents: general-purpose. Skills: none."},
        ],
        "system": [
            {"type": "text",
             "text": "x-anthropic-billing-header: cc_version=2.1.197.a5a; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Main prompt. " * 100, "cache_control": {"type": "ephemeral"}},
        ],
        "tools": tools,
        "metadata": {"user_id": '{"device_id":"ab","account_uuid":"","session_id":"sess-1"}'},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
        "some_future_field": {"x": 1},
    }


def sse_events(data: bytes) -> list[tuple[str | None, Any]]:
    out = []
    for frame in data.decode().split("\n\n"):
        if not frame.strip():
            continue
        name = None
        payload = None
        for line in frame.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                payload = line[6:] if line[6:] == "[DONE]" else orjson.loads(line[6:])
        out.append((name, payload))
    return out


def run_stream(proto: Protocol, prepared: Any, text: str, tok: PromptTokenizer, finish: str = "stop",
               chunk: int = 1,
               cached: int = 0) -> tuple[Any, bytes, list[int]]:
    ids = tok.encode_text(text).tolist()
    stream = proto.new_stream(prepared, "req1")
    data = stream.start(cached)
    for k in range(0, len(ids), chunk):
        data += stream.feed(ids[k : k + chunk])
        if stream.stop_hit:
            break
    data += stream.finish(finish, prepared.num_prompt_tokens, cached, len(stream.output_ids))
    return stream, data, ids


def echo_assistant(data: bytes) -> dict[str, Any]:
    """The assistant message a client builds from the stream (what Claude Code sends back)."""
    blocks: list[dict[str, Any]] = []
    for name, e in sse_events(data):
        if name == "content_block_start":
            blocks.append(dict(e["content_block"]))
            if blocks[-1]["type"] == "tool_use":
                blocks[-1]["_json"] = ""
        elif name == "content_block_delta":
            d, b = e["delta"], blocks[-1]
            if d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] = d["signature"]
            elif d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "input_json_delta":
                b["_json"] += d["partial_json"]
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = orjson.loads(b.pop("_json"))
    return {"role": "assistant", "content": blocks}
