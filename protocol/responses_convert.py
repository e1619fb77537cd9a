"""Responses API request -> the canonical conversation, plus what the emitter needs.

Input items map onto the conversation the chat path builds (docs/responses.md):

* ``instructions`` -> the system message at index 0; ``system``/``developer`` messages -> system
  messages (as on the chat path); ``user`` messages -> user turns.
* Consecutive ``reasoning``, assistant ``message``, ``function_call`` and ``custom_tool_call``
  items are one assistant turn; a ``reasoning`` item after text or calls starts the next turn.
* ``function_call_output`` / ``custom_tool_call_output`` -> tool results.
* A reasoning item's ``encrypted_content`` is the output ledger's handle for that turn (the
  same MAC'd handle as an Anthropic thinking signature); without it, an id ``rs_<32 hex>`` (ours)
  names the entry. So ``store: false`` clients replay the turn's exact generated ids.
* ``item_reference`` and ``previous_response_id`` resolve through the bounded ResponseStore.

Tools: ``function`` as is; ``namespace`` tools are flattened to ``<namespace>.<name>`` in the
prompt and their calls carry ``namespace`` back; ``custom`` (freeform) tools take one string
parameter ``input`` and come back as ``custom_tool_call`` items; ``web_search`` is not shown to
the model (no search backend here); any other hosted tool type is refused (400).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from pydantic import ValidationError

from protocol import responses_schema as R
from protocol.conversation import IMAGE_TEXT, Block, Conversation, Message, ToolCall, effort_value
from protocol.errors import InvalidRequest
from protocol.responses_store import ResponseStore

_OWN_REASONING_ID = re.compile(r"rs_([0-9a-f]{32})")
FUNCTION, CUSTOM = "function", "custom"


@dataclass(slots=True)
class ToolRoute:
    """How a prompt-side tool name maps back to a Responses output item."""

    kind: str  # FUNCTION | CUSTOM
    name: str  # the name the client declared
    namespace: str | None = None


@dataclass(slots=True)
class ResponsesOptions:
    routes: dict[str, ToolRoute] = field(default_factory=dict)  # prompt name -> route
    store: ResponseStore | None = None  # set when the response is to be stored
    owner: bytes = b""  # the caller's scope: the stored response is found only by it
    previous_response_id: str | None = None
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this request's items, for the store
    include_encrypted: bool = False
    echo: dict[str, Any] = field(default_factory=dict)  # request fields echoed in the response object


def _validation_error(exc: ValidationError, prefix: str) -> InvalidRequest:
    err = InvalidRequest.from_validation(exc)
    err.param = f"{prefix}.{err.param}" if err.param else prefix
    err.message = f"{prefix}: {err.message}"
    return err


def _parts_text(content: str | list[Any], where: str) -> str:
    if isinstance(content, str):
        return content
    out: list[str] = []
    for p in content:
        if isinstance(p, R.TextPart):
            out.append(p.text)
        elif isinstance(p, R.ImagePart):
            out.append(IMAGE_TEXT)
        elif p.type in ("input_file", "refusal"):
            text = getattr(p, "refusal", None)
            out.append(text if isinstance(text, str) else f"[Unsupported {p.type}]")
        else:
            raise InvalidRequest(f"{where}: unsupported content part type {p.type!r}", param=where)
    return "\n\n".join(out)


def _tools(raw_tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], dict[str, ToolRoute]]:
    tools: list[dict[str, Any]] = []
    routes: dict[str, ToolRoute] = {}

    def add(t: R.FunctionTool | R.CustomTool, namespace: str | None) -> None:
        prompt_name = f"{namespace}.{t.name}" if namespace else t.name
        fn: dict[str, Any] = {"name": prompt_name}
        if t.description is not None:
            fn["description"] = t.description
        if isinstance(t, R.CustomTool):
            hint = "The tool's whole input, as free text"
            if t.format and t.format.get("type") == "grammar":
                syntax, definition = t.format.get("syntax", "grammar"), t.format.get("definition", "")
                hint += f" in this {syntax} grammar:\n{definition}"
            fn["parameters"] = {"type": "object",
                                "properties": {"input": {"type": "string", "description": hint}},
                                "required": ["input"]}
            routes[prompt_name] = ToolRoute(CUSTOM, t.name, namespace)
        else:
            fn["parameters"] = t.parameters if t.parameters is not None else {
                "type": "object", "properties": {}}
            routes[prompt_name] = ToolRoute(FUNCTION, t.name, namespace)
        tools.append(fn)

    models: dict[str, type[R.FunctionTool | R.CustomTool | R.NamespaceTool]] = {
        "function": R.FunctionTool, "custom": R.CustomTool, "namespace": R.NamespaceTool}
    for k, raw in enumerate(raw_tools or []):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind in R.IGNORED_TOOL_TYPES:
            continue
        if kind not in models:
            raise InvalidRequest(f"tools.{k}: tool type {kind!r} is not supported by this server "
                                 "(function, custom, namespace; web_search is accepted and not used)",
                                 param=f"tools.{k}.type")
        try:
            tool = models[kind].model_validate(raw)
        except ValidationError as exc:
            raise _validation_error(exc, f"tools.{k}") from None
        if isinstance(tool, R.NamespaceTool):
            for inner in tool.tools:
                add(inner, tool.name)
        else:
            add(tool, None)
    return tools, routes


class _Builder:
    """Appends input items to the message list, grouping assistant items into turns."""

    def __init__(self, signature_of: Callable[[bytes], str]) -> None:
        self.messages: list[Message] = []
        self._turn: Message | None = None  # the open assistant turn
        self._signature_of = signature_of

    def add(self, item: R.InputItem, where: str) -> None:
        if isinstance(item, R.MessageItem):
            if item.role == "assistant":
                text = _parts_text(item.content, where)
                turn = self._assistant(new=False)
                turn.text_parts.append(text)
                turn.content += text
                return
            self._turn = None
            text = _parts_text(item.content, where)
            if item.role == "user":
                self.messages.append(Message(role="user", blocks=[Block(kind="text", text=text)]))
            else:
                self.messages.append(Message(role="system", content=text))
        elif isinstance(item, R.ReasoningItem):
            turn = self._assistant(new=True)
            parts = item.content if item.content else item.summary
            if parts:
                turn.reasoning = (turn.reasoning or "") + "".join(p.text for p in parts)
            if turn.signature is None:
                turn.signature = item.encrypted_content or self._own_signature(item.id)
        elif isinstance(item, R.FunctionCallItem):
            name = f"{item.namespace}.{item.name}" if item.namespace else item.name
            self._assistant(new=False).tool_calls.append(ToolCall(id=item.call_id, name=name,
                                                                  arguments=item.arguments))
        elif isinstance(item, R.CustomToolCallItem):
            self._assistant(new=False).tool_calls.append(ToolCall(id=item.call_id, name=item.name,
                                                                  arguments={"input": item.input}))
        elif isinstance(item, R.CallOutputItem):
            self._turn = None
            self.messages.append(Message(role="tool", tool_call_id=item.call_id,
                                         content=_parts_text(item.output, where)))

    def _assistant(self, new: bool) -> Message:
        turn = self._turn
        if turn is None or (new and (turn.content or turn.tool_calls or turn.reasoning is not None)):
            turn = Message(role="assistant")
            self.messages.append(turn)
            self._turn = turn
        return turn

    def _own_signature(self, item_id: str | None) -> str | None:
        m = _OWN_REASONING_ID.fullmatch(item_id or "")
        return self._signature_of(bytes.fromhex(m.group(1))) if m else None


def _parse_item(raw: object, where: str) -> R.InputItem:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where}: an input item must be an object", param=where)
    kind = raw.get("type", "message" if "role" in raw else None)
    model = R.ITEM_MODELS.get(kind)  # type: ignore[arg-type]
    if model is None:
        raise InvalidRequest(f"{where}: unsupported input item type {kind!r}", param=f"{where}.type")
    try:
        return cast(R.InputItem, model.model_validate(raw if "type" in raw else {**raw, "type": kind}))
    except ValidationError as exc:
        raise _validation_error(exc, where) from None


def responses_conversation(req: R.ResponsesRequest, store: ResponseStore | None,
                           signature_of: Callable[[bytes], str],
                           owner: bytes = b"") -> tuple[Conversation, ResponsesOptions]:
    tools, routes = _tools(req.tools)
    own: list[dict[str, Any]] = ([{"type": "message", "role": "user", "content": req.input}]
                                 if isinstance(req.input, str) else list(req.input))
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        found = store.history(req.previous_response_id, owner) if store is not None else None
        if found is None:
            raise InvalidRequest(
                f"previous_response_id {req.previous_response_id!r} is not stored here (responses are kept "
                "in a bounded in-memory store, lost on restart); send the whole conversation in input",
                param="previous_response_id", code="previous_response_not_found")
        history = found
    builder = _Builder(signature_of)
    if req.instructions:
        builder.messages.append(Message(role="system", content=req.instructions))
    for k, raw in enumerate(history + own):
        where = f"input.{k - len(history)}" if k >= len(history) else "previous_response_id"
        item = _parse_item(raw, where)
        if isinstance(item, R.ItemReference):
            ref = store.item(item.id, owner) if store is not None else None
            if ref is None:
                raise InvalidRequest(f"{where}: item_reference {item.id!r} is not stored here; "
                                     "send the item itself", param=where, code="item_not_found")
            item = _parse_item(ref, where)
        builder.add(item, where)
    if not any(m.role in ("user", "tool") for m in builder.messages):
        raise InvalidRequest("input must contain at least one user message or tool output", param="input")
    effort = req.reasoning.effort if req.reasoning else None
    thinking = effort != "none"
    fmt = req.text.format.model_dump(exclude_none=True) if req.text and req.text.format else None
    if fmt is not None and fmt.get("type") == "text":
        fmt = None
    if fmt is not None and fmt.get("type") == "json_schema":  # Responses flattens what chat nests
        fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    conv = Conversation(messages=builder.messages, tools=tools, thinking=thinking,
                        effort=effort_value(None if effort in (None, "none") else effort),
                        response_format=fmt)
    opts = ResponsesOptions(
        routes=routes,
        store=store if req.store else None,
        owner=owner,
        previous_response_id=req.previous_response_id,
        input_items=own,
        include_encrypted="reasoning.encrypted_content" in (req.include or ()),
        echo={
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": effort, "summary": req.reasoning.summary if req.reasoning else None},
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": req.text.format.model_dump(exclude_none=True)
                     if req.text and req.text.format else {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": req.truncation or "disabled",
            "metadata": req.metadata or {},
        },
    )
    return conv, opts
