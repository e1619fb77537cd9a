"""Parser events -> the OpenAI Responses event stream and the response object.

Stream (every event carries ``sequence_number``)::

    response.created, response.in_progress
    reasoning:  output_item.added, reasoning_summary_part.added, reasoning_summary_text.delta*,
                reasoning_summary_text.done, reasoning_summary_part.done, output_item.done
    text:       output_item.added (message), content_part.added, output_text.delta*,
                output_text.done, content_part.done, output_item.done
    call:       output_item.added (function_call, arguments ""), function_call_arguments.delta*
                (as the parser streams them), function_call_arguments.done, output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed (error)

The model's reasoning is sent as the reasoning item's summary (there is no separate
summarizer); ``encrypted_content`` is the output ledger's handle when the request includes
``reasoning.encrypted_content``, and the item id ``rs_<entry id>`` names it as well. Custom
(freeform) tool calls become ``custom_tool_call`` items whose ``input`` is sent whole when the
call completes; namespaced calls carry ``namespace``. A call cut by max_output_tokens is closed
with ``status: "incomplete"`` and left out of the final ``output``.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from protocol.parser import REASONING, TEXT, TOOL, TOOL_ARGS, TOOL_START, Event, ParsedCall
from protocol.responses_convert import CUSTOM, ResponsesOptions, ToolRoute


def responses_usage(num_prompt: int, num_cached: int, num_output: int, num_reasoning: int) -> dict[str, Any]:
    return {
        "input_tokens": num_prompt,
        "input_tokens_details": {"cached_tokens": max(0, min(num_cached, num_prompt))},
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": num_reasoning},
        "total_tokens": num_prompt + num_output,
    }


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)  # 128 random bits: an item id cannot be guessed


class ResponsesEmitter:
    """One response's output items and (when streaming) its SSE bytes. Not thread-safe."""

    def __init__(self, response_id: str, model: str, opts: ResponsesOptions, reasoning_id: str,
                 encrypted_content: str, stream: bool) -> None:
        self.response_id = response_id
        self.model = model
        self.opts = opts
        self.created_at = int(time.time())
        self._reasoning_id = reasoning_id
        self._encrypted = encrypted_content if opts.include_encrypted else None
        self._stream = stream
        self._seq = 0
        self.items: list[dict[str, Any]] = []  # finished output items, in order
        self._open: dict[str, Any] | None = None  # the item being generated
        self._open_kind = -1
        self._buf: list[str] = []  # the open item's text / arguments so far
        self._route: ToolRoute | None = None

    # --- frames --------------------------------------------------------------------------------
    def _ev(self, out: list[bytes], kind: str, payload: dict[str, Any]) -> None:
        if not self._stream:
            return
        payload["sequence_number"] = self._seq
        self._seq += 1
        out.append(
            b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **payload}) + b"\n\n")

    def response(self, status: str, usage: dict[str, Any] | None, incomplete: str | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "model": self.model,
            "output": self.items if status != "in_progress" else [],
            "usage": usage,
            **self.opts.echo,
        }

    def start(self) -> bytes:
        out: list[bytes] = []
        skeleton = self.response("in_progress", None)
        self._ev(out, "response.created", {"response": skeleton})
        self._ev(out, "response.in_progress", {"response": skeleton})
        return b"".join(out)

    # --- items ---------------------------------------------------------------------------------
    def _begin(self, out: list[bytes], kind: int, item: dict[str, Any]) -> None:
        self._close(out)
        self._open, self._open_kind, self._buf = item, kind, []
        self._ev(out, "response.output_item.added", {"output_index": len(self.items), "item": item})

    def _close(self, out: list[bytes], cut: bool = False) -> None:
        item = self._open
        if item is None:
            return
        index = len(self.items)
        ref = {"item_id": item["id"], "output_index": index}
        text = "".join(self._buf)
        if self._open_kind == REASONING:
            part: dict[str, Any] = {"type": "summary_text", "text": text}
            self._ev(out, "response.reasoning_summary_text.done", {**ref, "summary_index": 0, "text": text})
            self._ev(out, "response.reasoning_summary_part.done", {**ref, "summary_index": 0, "part": part})
            item = {**item, "summary": [part]}
        elif self._open_kind == TEXT:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            self._ev(out, "response.output_text.done",
                     {**ref, "content_index": 0, "text": text, "logprobs": []})
            self._ev(out, "response.content_part.done", {**ref, "content_index": 0, "part": part})
            item = {**item, "status": "completed", "content": [part]}
        else:  # a call; ``_finish_call`` closes complete ones, so this one was cut
            item = {**item, "status": "incomplete"}
            if item["type"] == "function_call":
                item["arguments"] = text
        self._open, self._open_kind, self._buf = None, -1, []
        self._ev(out, "response.output_item.done", {"output_index": index, "item": item})
        if not cut:
            self.items.append(item)

    def emit(self, events: list[Event], call_ids: list[str]) -> bytes:
        out: list[bytes] = []
        for kind, payload in events:
            if kind == REASONING:
                if self._open_kind != REASONING:
                    item = {"id": self._reasoning_id, "type": "reasoning", "summary": []}
                    if self._encrypted is not None:
                        item["encrypted_content"] = self._encrypted
                    self._begin(out, REASONING, item)
                    self._ev(out, "response.reasoning_summary_part.added", {
                        "item_id": item["id"], "output_index": len(self.items), "summary_index": 0,
                        "part": {"type": "summary_text", "text": ""}})
                self._delta(out, "response.reasoning_summary_text.delta", payload, {"summary_index": 0})
            elif kind == TEXT:
                if self._open_kind != TEXT:
                    item = {"id": _new_id("msg_"), "type": "message", "status": "in_progress",
                            "role": "assistant", "content": []}
                    self._begin(out, TEXT, item)
                    self._ev(out, "response.content_part.added", {
                        "item_id": item["id"], "output_index": len(self.items), "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
                self._delta(out, "response.output_text.delta", payload, {"content_index": 0, "logprobs": []})
            elif kind == TOOL_START:
                index, name = payload
                self._begin(out, TOOL_START, self._call_item(call_ids[index], name))
            elif kind == TOOL_ARGS:
                if self._route is not None and self._route.kind == CUSTOM:
                    self._buf.append(payload)  # the input goes out whole, decoded, at the end
                else:
                    self._delta(out, "response.function_call_arguments.delta", payload, {})
            elif kind == TOOL:
                self._finish_call(out, payload)
        return b"".join(out)

    def _delta(self, out: list[bytes], kind: str, text: str, extra: dict[str, Any]) -> None:
        self._buf.append(text)
        if self._stream:
            assert self._open is not None
            self._ev(out, kind,
                     {"item_id": self._open["id"], "output_index": len(self.items), **extra, "delta": text})

    def _call_item(self, call_id: str, prompt_name: str) -> dict[str, Any]:
        route = self.opts.routes.get(prompt_name)
        self._route = route
        if route is not None and route.kind == CUSTOM:
            item = {"id": _new_id("ctc_"), "type": "custom_tool_call", "status": "in_progress",
                    "call_id": call_id,
                    "name": route.name, "input": ""}
        else:  # a declared function, or an undeclared name passed through as is (docs/protocol.md)
            item = {"id": _new_id("fc_"), "type": "function_call", "status": "in_progress",
                    "call_id": call_id,
                    "name": route.name if route is not None else prompt_name, "arguments": ""}
        if route is not None and route.namespace:
            item["namespace"] = route.namespace
        return item

    def _finish_call(self, out: list[bytes], call: ParsedCall) -> None:
        item = self._open
        assert item is not None
        index = len(self.items)
        ref = {"item_id": item["id"], "output_index": index}
        if item["type"] == "custom_tool_call":
            value = call.arguments.get("input")
            text = value if isinstance(value, str) else call.arguments_json
            self._ev(out, "response.custom_tool_call_input.delta", {**ref, "delta": text})
            self._ev(out, "response.custom_tool_call_input.done", {**ref, "input": text})
            done = {**item, "status": "completed", "input": text}
        else:
            self._ev(out, "response.function_call_arguments.done",
                     {**ref, "name": item["name"], "arguments": call.arguments_json})
            done = {**item, "status": "completed", "arguments": call.arguments_json}
        self._open, self._open_kind, self._buf, self._route = None, -1, [], None
        self._ev(out, "response.output_item.done", {"output_index": index, "item": done})
        self.items.append(done)

    # --- the end -------------------------------------------------------------------------------
    def finish(self, reason: str, usage: dict[str, Any]) -> bytes:
        """``reason`` is the stream's (``length`` -> incomplete). Records the store entry."""
        out: list[bytes] = []
        self._close(out, cut=self._open_kind == TOOL_START)
        incomplete = "max_output_tokens" if reason == "length" else None
        body = self.response("incomplete" if incomplete else "completed", usage, incomplete)
        self._ev(out, "response.incomplete" if incomplete else "response.completed", {"response": body})
        self.body = body
        store = self.opts.store
        if store is not None:
            store.record(self.response_id, self.opts.owner, self.opts.previous_response_id,
                         self.opts.input_items, self.items)
        return b"".join(out)

    def failed(self, code: str, message: str) -> bytes:
        out: list[bytes] = []
        self._close(out, cut=True)
        self._ev(out, "response.failed",
                 {"response": self.response("failed", None, error={"code": code, "message": message})})
        return b"".join(out)
