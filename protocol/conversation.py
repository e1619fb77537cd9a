"""The canonical conversation both APIs convert into, and the one pinned reasoning-effort map.

A ``Conversation`` is what ``render.py`` turns into a V4.1 prompt. Conversion keeps client text
verbatim (nothing is escaped or trimmed); the only thing dropped is Claude Code's per-request
``x-anthropic-billing-header`` system block (it changes every request and would break the
prefix cache; Claude Code's captured traffic, ``docs/claude-code.md``).

Deferred tools (Anthropic ``defer_loading``): they stay out of ``tools`` (the prompt's tools
block) and sit in ``tool_catalog``; a ``tool_reference`` in a tool result becomes a
``PART_TOOL_REFS`` part that ``render.py`` expands into the definitions at that point, so
loading a tool never changes the prompt before it (docs/protocol.md, "Deferred tools").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protocol import anthropic_schema as A, openai_schema as O
from protocol.errors import InvalidRequest

if TYPE_CHECKING:
    from protocol.ledger import LedgerEntry

# --- reasoning effort -------------------------------------------------------------------------
# Pinned mapping (docs/protocol.md explains the choice). Anchored on the checkpoint's own
# encoder (low=50, high=75, max=100, default high); the other names sit between those anchors.
EFFORT_LEVELS: dict[str, int] = {
    "minimal": 25,
    "low": 50,
    "medium": 62,
    "high": 75,
    "xhigh": 88,
    "max": 100,
}
DEFAULT_EFFORT = EFFORT_LEVELS["high"]
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
IMAGE_TEXT = "[Unsupported image]"  # no vision path on this deployment; see docs/protocol.md


# Kinds of a tool result's parts (``Block.parts``): client text (placeholders such as
# ``[Unsupported <type>]`` too: they hold the client's type string), or a run of tool references
# (payload: the tuple of tool names it loads). No kind is template text: nothing a client sends
# is ever rendered as ours (where special-token strings become control tokens).
class PartKind(enum.IntEnum):
    CLIENT = 1  # payload: str
    TOOL_REFS = 2  # payload: tuple[str, ...] (the tool names)


PART_CLIENT, PART_TOOL_REFS = PartKind.CLIENT, PartKind.TOOL_REFS


@dataclass(slots=True)
class Block:
    """One user-turn block: ``text`` (client text), ``tool_result`` (``parts`` are (PART_*,
    payload) pairs joined by "\\n\\n") or ``other`` (a placeholder such as
    ``[Unsupported image]``, rendered as client text)."""

    kind: str
    text: str = ""
    tool_use_id: str = ""
    parts: list[tuple[PartKind, Any]] = field(default_factory=list)


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any] | str  # Anthropic input (parsed) or the raw OpenAI arguments string


@dataclass(slots=True)
class Message:
    role: str  # system | developer | user | assistant | tool
    content: str = ""
    blocks: list[Block] | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str = ""
    text_parts: list[str] = field(default_factory=list)  # assistant text blocks as received
    signature: str | None = None  # first thinking signature (Anthropic)
    ledger_entry: LedgerEntry | None = None  # when the client's view matched the ledger


@dataclass(slots=True)
class Conversation:
    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)  # ``function`` objects of the tools block
    thinking: bool = False
    effort: int = DEFAULT_EFFORT
    response_format: dict[str, Any] | None = None  # the JSON schema object the prompt prints
    # every declared tool by name, deferred ones included: what a tool_reference can load
    tool_catalog: dict[str, dict[str, Any]] = field(default_factory=dict)
    loaded_tools: list[str] = field(default_factory=list)  # referenced tools, first reference first

    def callable_tools(self) -> list[dict[str, Any]]:
        """The tools the model is offered: the tools block plus the ones references loaded."""
        shown = {t.get("name") for t in self.tools}
        return self.tools + [self.tool_catalog[n] for n in self.loaded_tools if n not in shown]


def effort_value(name: str | int | None) -> int:
    if name is None:
        return DEFAULT_EFFORT
    if isinstance(name, bool):
        raise InvalidRequest("reasoning effort must be a name or an integer 1-100", param="reasoning_effort")
    if isinstance(name, int):
        if 1 <= name <= 100:
            return name
        raise InvalidRequest("reasoning effort must be within 1-100", param="reasoning_effort")
    try:
        return EFFORT_LEVELS[name]
    except KeyError:
        raise InvalidRequest(
            f"unknown reasoning effort {name!r}; use one of {', '.join(EFFORT_LEVELS)}",
            param="reasoning_effort",
        ) from None


# --- Anthropic ----------------------------------------------------------------------------------
def _tool_result_parts(content: str | list[Any] | None) -> list[tuple[PartKind, Any]]:
    if content is None:
        return [(PART_CLIENT, "")]
    if isinstance(content, str):
        return [(PART_CLIENT, content)]
    parts: list[tuple[PartKind, Any]] = []
    for p in content:
        if p.type == "tool_reference":
            if parts and parts[-1][0] == PART_TOOL_REFS:  # one definitions block per run
                parts[-1] = (PART_TOOL_REFS, parts[-1][1] + (p.tool_name,))
            else:
                parts.append((PART_TOOL_REFS, (p.tool_name,)))
        elif p.type == "text":
            parts.append((PART_CLIENT, p.text))
        elif p.type == "image":
            parts.append((PART_CLIENT, IMAGE_TEXT))
        else:
            parts.append((PART_CLIENT, f"[Unsupported {p.type}]"))
    return parts or [(PART_CLIENT, "")]


def _anthropic_system_text(system: str | list[A.TextBlock] | None) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    texts = [b.text for b in system if not b.text.startswith(BILLING_HEADER_PREFIX)]
    return "\n\n".join(texts)


def anthropic_conversation(
    req: A.MessagesRequest | A.CountTokensRequest, raw_tools: list[dict[str, Any]] | None
) -> Conversation:
    conv = anthropic_head(req, raw_tools)
    loaded: dict[str, None] = {}  # an ordered set
    conv.messages += anthropic_messages(req.messages, 0, conv.tool_catalog, loaded)
    conv.loaded_tools = list(loaded)
    return conv


def anthropic_head(
    req: A.MessagesRequest | A.CountTokensRequest, raw_tools: list[dict[str, Any]] | None
) -> Conversation:
    """The conversation of everything but ``req.messages``: tools, catalog, modes, and the system
    message when there is one (``anthropic_messages`` converts the messages)."""
    raw: list[dict[str, Any] | None] = list(raw_tools) if raw_tools else [None] * len(req.tools or [])
    declared = [_anthropic_tool(t, raw[k]) for k, t in enumerate(req.tools or [])]
    tools = [fn for t, fn in zip(req.tools or [], declared) if not t.defer_loading]
    catalog: dict[str, dict[str, Any]] = {}
    for fn in declared:
        catalog.setdefault(fn["name"], fn)
    msgs: list[Message] = []
    sys_text = _anthropic_system_text(req.system)
    if sys_text is not None and (sys_text or req.tools):
        msgs.append(Message(role="system", content=sys_text))
    thinking = req.thinking is not None and req.thinking.type != "disabled"
    effort = effort_value(req.output_config.effort if req.output_config else None)
    fmt = req.output_config.format if req.output_config else None
    return Conversation(messages=msgs, tools=tools, thinking=thinking, effort=effort, response_format=fmt,
                        tool_catalog=catalog)


def anthropic_messages(messages: list[A.Message], first_index: int, catalog: dict[str, dict[str, Any]],
                       loaded: dict[str, None]) -> list[Message]:
    """One ``Message`` per wire message; ``first_index``: the request index of ``messages[0]``
    (errors name it); tool references are checked against ``catalog`` and added to ``loaded``."""
    msgs: list[Message] = []
    for i, m in enumerate(messages, first_index):
        if m.role == "assistant":
            msgs.append(_anthropic_assistant(m.content))
        elif m.role == "system":
            if isinstance(m.content, str):
                text = m.content
            else:
                text = "\n\n".join(b.text for b in m.content if isinstance(b, A.TextBlock))
            msgs.append(Message(role="system", content=text))
        else:
            msgs.append(Message(role="user", blocks=_anthropic_user_blocks(m.content, i, catalog, loaded)))
    return msgs


def _anthropic_user_blocks(
    content: str | list[Any], msg_index: int, catalog: dict[str, dict[str, Any]], loaded: dict[str, None]
) -> list[Block]:
    """The user turn's blocks; tool references are checked against ``catalog`` (a reference to
    an undeclared tool is a 400, as in Anthropic's API) and their names added to ``loaded``."""
    if isinstance(content, str):
        return [Block(kind="text", text=content)]
    blocks: list[Block] = []
    for k, b in enumerate(content):
        t = b.type
        if t == "text":
            blocks.append(Block(kind="text", text=b.text))
        elif t == "tool_result":
            parts = _tool_result_parts(b.content)
            for name in (n for kind, names in parts if kind == PART_TOOL_REFS for n in names):
                if name not in catalog:
                    where = f"messages.{msg_index}.content.{k}"
                    raise InvalidRequest(f"{where}: tool_reference names {name!r}, which is not in tools",
                                         param=where)
                loaded.setdefault(name)
            blocks.append(Block(kind="tool_result", tool_use_id=b.tool_use_id, parts=parts))
        elif t == "image":
            blocks.append(Block(kind="other", text=IMAGE_TEXT))
        elif t in ("thinking", "redacted_thinking", "tool_use"):
            raise InvalidRequest(
                f"messages.{msg_index}: a user message cannot contain {t} blocks",
                param=f"messages.{msg_index}"
            )
        else:
            blocks.append(Block(kind="other", text=f"[Unsupported {t}]"))
    return blocks


def _anthropic_assistant(content: str | list[Any]) -> Message:
    if isinstance(content, str):
        return Message(role="assistant", content=content, text_parts=[content] if content else [])
    reasoning: list[str] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    signature: str | None = None
    saw_thinking = False
    for b in content:
        t = b.type
        if t == "thinking":
            saw_thinking = True
            reasoning.append(b.thinking)
            if signature is None and b.signature:
                signature = b.signature
        elif t == "redacted_thinking":
            saw_thinking = True  # opaque to us; cannot be rendered
        elif t == "text":
            texts.append(b.text)
        elif t == "tool_use":
            calls.append(ToolCall(id=b.id, name=b.name, arguments=b.input))
        # images/other blocks in assistant turns have no V4.1 rendering; they are skipped
    return Message(
        role="assistant",
        content="\n\n".join(texts),
        text_parts=texts,
        reasoning="".join(reasoning) if saw_thinking else None,
        tool_calls=calls,
        signature=signature,
    )


def _anthropic_tool(tool: A.Tool, raw: dict[str, Any] | None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": tool.name}
    desc = raw.get("description") if isinstance(raw, dict) else tool.description
    if desc is not None:
        fn["description"] = desc
    schema = raw.get("input_schema") if isinstance(raw, dict) else None
    fn["parameters"] = schema if isinstance(schema, dict) else tool.input_schema
    return fn


# --- OpenAI ---------------------------------------------------------------------------------------
def _openai_text(content: str | list[Any] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out: list[str] = []
    for p in content:
        if p.type in ("text", "input_text"):
            # a text part without a string "text" fails TextPart and lands in OtherPart
            text = getattr(p, "text", None)
            if not isinstance(text, str):
                raise InvalidRequest(f"a content part of type {p.type!r} needs a string 'text'",
                                     param="messages")
            out.append(text)
        elif p.type in ("image_url", "input_image"):
            out.append(IMAGE_TEXT)
        else:
            raise InvalidRequest(f"unsupported content part type {p.type!r}", param="messages")
    return "\n\n".join(out)


def openai_thinking(req: O.ChatCompletionRequest) -> tuple[bool, int]:
    """vLLM's switch: thinking is on unless turned off by any of the accepted controls."""
    kwargs = req.chat_template_kwargs or {}
    thinking = True
    for key in ("thinking", "enable_thinking"):
        if key in kwargs and not kwargs[key]:
            thinking = False
    if isinstance(req.thinking, dict) and req.thinking.get("type") == "disabled":
        thinking = False
    effort: str | int | None = req.reasoning_effort
    if effort is None:
        effort = kwargs.get("reasoning_effort")
    if effort == "none":
        return False, DEFAULT_EFFORT
    return thinking, effort_value(effort)


def openai_conversation(req: O.ChatCompletionRequest, raw_tools: list[dict[str, Any]] | None) -> Conversation:
    conv = openai_head(req, raw_tools)
    conv.messages = openai_messages(req.messages)
    return conv


def openai_messages(messages: list[O.ChatMessage]) -> list[Message]:
    """One ``Message`` per wire message (each converts on its own)."""
    msgs: list[Message] = []
    for m in messages:
        role = m.role
        if role in ("system", "developer"):
            # "developer" is OpenAI's newer name for the system role (not V4.1's developer turn,
            # which drop_thinking would delete from history)
            msgs.append(Message(role="system", content=_openai_text(m.content)))
        elif role == "user":
            msgs.append(Message(role="user", blocks=[Block(kind="text", text=_openai_text(m.content))]))
        elif role in ("tool", "function"):
            tcid = m.tool_call_id if role == "tool" else (m.name or "")
            msgs.append(Message(role="tool", tool_call_id=tcid or "", content=_openai_text(m.content)))
        else:
            text = _openai_text(m.content)
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            calls = [ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                     for c in m.tool_calls or []]
            msgs.append(
                Message(role="assistant", content=text, text_parts=[text] if text else [],
                        reasoning=reasoning, tool_calls=calls)
            )
    return msgs


def openai_head(req: O.ChatCompletionRequest, raw_tools: list[dict[str, Any]] | None) -> Conversation:
    """The conversation of everything but ``req.messages`` (``openai_messages`` converts those)."""
    tools: list[dict[str, Any]] = []
    for k, t in enumerate(req.tools or []):
        raw = raw_tools[k].get("function") if raw_tools and isinstance(raw_tools[k], dict) else None
        tools.append(raw if isinstance(raw, dict) else t.function.model_dump(exclude_none=True))
    thinking, effort = openai_thinking(req)
    fmt = None
    if req.response_format is not None and req.response_format.type != "text":
        fmt = req.response_format.model_dump(exclude_none=True)
    return Conversation(messages=[], tools=tools, thinking=thinking, effort=effort, response_format=fmt)
