"""Parser events -> OpenAI chat.completion.chunk SSE frames and chat.completion bodies.

Reasoning goes in ``delta.reasoning_content`` (DeepSeek/vLLM convention); a tool call opens
with a ``tool_calls`` delta carrying index, id, type, name and ``arguments: ""``, then argument
deltas as the parser streams them (``index`` + ``function.arguments``); usage
carries ``prompt_tokens_details.cached_tokens``. The chunk prefix (id, created, model) is
serialized once per stream, so a delta costs one ``orjson.dumps`` of its text.
"""

from __future__ import annotations

from typing import Any

import orjson

from protocol.parser import REASONING, TEXT, TOOL_ARGS, TOOL_START, Event, ParsedCall

FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "stop_sequence": "stop"}


def openai_usage(num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> dict[str, Any]:
    cached = max(0, min(num_cached_tokens, num_prompt_tokens))
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class OpenAIEmitter:
    __slots__ = ("completion_id", "model", "created", "_head", "_tail", "_call_head")

    def __init__(self, completion_id: str, model: str, created: int) -> None:
        self.completion_id = completion_id
        self.model = model
        self.created = created
        head = orjson.dumps({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                             "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":0,"delta":{'
        self._tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        self._call_head = b""  # the open call's argument-delta prefix

    def start(self) -> bytes:
        return self._head + b'"role":"assistant","content":""' + self._tail

    def emit(self, events: list[Event], call_ids: list[str]) -> bytes:
        out: list[bytes] = []
        for kind, payload in events:
            if kind == TEXT:
                out.append(self._head + b'"content":' + orjson.dumps(payload) + self._tail)
            elif kind == REASONING:
                out.append(self._head + b'"reasoning_content":' + orjson.dumps(payload) + self._tail)
            elif kind == TOOL_START:
                index, name = payload
                tc = {"index": index, "id": call_ids[index], "type": "function",
                      "function": {"name": name, "arguments": ""}}
                out.append(self._head + b'"tool_calls":' + orjson.dumps([tc]) + self._tail)
                self._call_head = self._head + b'"tool_calls":[{"index":%d,"function":{"arguments":' % index
            elif kind == TOOL_ARGS:
                out.append(self._call_head + orjson.dumps(payload) + b"}}]" + self._tail)
        return b"".join(out)

    def finish(self, finish_reason: str, usage: dict[str, Any] | None) -> bytes:
        base = {"id": self.completion_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model}
        out = [
            b"data: "
            + orjson.dumps({**base,
                            "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                         "finish_reason": finish_reason}]})
            + b"\n\n"
        ]
        if usage is not None:
            out.append(b"data: " + orjson.dumps({**base, "choices": [], "usage": usage}) + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)


def openai_body(
    completion_id: str,
    model: str,
    created: int,
    reasoning: str,
    text: str,
    calls: list[ParsedCall],
    call_ids: list[str],
    finish_reason: str,
    usage: dict[str, Any],
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": call_ids[c.index], "type": "function",
             "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in calls
        ]
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage,
    }
