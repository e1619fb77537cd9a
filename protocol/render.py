"""Conversation -> the exact DeepSeek-V4.1 prompt, as a list of segments.

Follows the checkpoint's encoder as vLLM implements it
(``vllm/tokenizers/deepseek_v41_encoding.py``). A segment is ``(kind, payload)``:

* ``OURS``: template text; it may contain special-token strings, which the tokenizer matches.
* ``CLIENT``: client text (messages, tool results, tool schemas, tool names and arguments);
  the tokenizer never turns any of it into control tokens.
* ``IDS``: token ids taken verbatim from the output ledger (an assistant turn the model
  generated and the client echoed back unchanged).

Deliberate deviation from vLLM's wrapper: tools always attach to the system message at index 0
(inserting an empty one), never to a later inline system message, so an inline system message
cannot move the tools block (a cache breaker, section 2).

Deferred tools are not in the tools block; a tool result's tool references render, in place, as
a ``<functions>`` block holding each loaded tool's schema line exactly as the tools block would
print it, wrapped in ``<function>`` tags (the format Claude Code's ToolSearch description
promises the model). Loading a tool therefore only appends to the prompt.
"""

from __future__ import annotations

import enum
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from protocol.conversation import PART_CLIENT, PART_TOOL_REFS, Block, Conversation, Message, ToolCall
from protocol.depth import check_json_text_depth


class SegmentKind(enum.IntEnum):
    """What a segment's payload is (module docstring); the tokenizer treats each differently."""

    OURS = 0  # template text: special-token strings in it become control tokens
    CLIENT = 1  # client text: never turned into control tokens
    IDS = 2  # token ids from the output ledger, taken verbatim


OURS, CLIENT, IDS = SegmentKind.OURS, SegmentKind.CLIENT, SegmentKind.IDS

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"

EFFORT_TEMPLATE = (
    "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
RESPONSE_FORMAT_HEAD = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

TOOLS_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by "
    f'writing a "<{DSML} calls>" block like the following:\n\n'
    f"<{DSML} calls>\n"
    f'<{DSML} invoke name="$TOOL_NAME">\n'
    f'<{DSML} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML} parameter>\n'
    "...\n"
    f"</{DSML} invoke>\n"
    f'<{DSML} invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML} invoke>\n"
    f"</{DSML} calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning "
    f"inside {THINK}...{END_THINK} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {END_THINK} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
FUNCTIONS_OPEN = "<functions>"
FUNCTIONS_CLOSE = "\n</functions>"
FUNCTION_OPEN = "\n<function>"
FUNCTION_CLOSE = "</function>"

Segment = tuple[SegmentKind, Any]
# An assistant turn the output ledger may stand in for: segments [start, end) render it from the
# client's view; the segment before ``start`` is the generation header (the prompt it was
# generated from ends there); ``with_reasoning``: its reasoning is part of the prompt.
AssistantSpan = tuple[int, int, Message, bool]
GENERATION_HEADERS = frozenset({ASSISTANT + THINK, ASSISTANT + END_THINK})


def to_json(value: Any) -> str:
    """The encoder's JSON: ``json.dumps(ensure_ascii=False)`` (", " and ": " separators)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True, default=str)


SchemaText = Callable[[list[dict[str, Any]]], str]


def tools_schema_text(tools: list[dict[str, Any]]) -> str:
    """One schema per line (uncached; ``ToolsTextCache.text`` is the memoized form)."""
    return "\n".join(to_json(t) for t in tools)


class ToolsTextCache:
    """``tools_schema_text`` memoized by a 128-bit hash of the tools' compact JSON, least
    recently used out past ``max_entries``. Tools are byte-identical across a session's turns,
    and json.dumps of a 70 KB tool list costs milliseconds on every turn otherwise.
    Thread-safe: requests are prepared in worker threads."""

    def __init__(self, max_entries: int = 256) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._texts: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._texts)

    def text(self, tools: list[dict[str, Any]]) -> str:
        try:
            key = xxhash.xxh3_128_intdigest(orjson.dumps(tools))
        except TypeError:  # not plain JSON (json.dumps' default=str handles it): not cached
            return tools_schema_text(tools)
        with self._lock:
            text = self._texts.get(key)
            if text is not None:
                self._texts.move_to_end(key)
                return text
        text = tools_schema_text(tools)
        with self._lock:
            self._texts[key] = text
            self._texts.move_to_end(key)
            while len(self._texts) > self.max_entries:
                self._texts.popitem(last=False)
        return text


def arguments_dict(arguments: Any) -> dict[str, Any]:
    """The encoder's rule: a dict as is; a string parsed as JSON (twice for double encoding);
    anything that is still not a dict becomes ``{"arguments": raw}``."""
    if isinstance(arguments, dict):
        return arguments
    value = arguments
    for _ in range(2):
        if isinstance(value, str):
            check_json_text_depth(value, "arguments")  # a 400, not json.loads' RecursionError
            try:
                value = json.loads(value)
            except ValueError:
                break
        else:
            break
    if isinstance(value, dict):
        return value
    return {"arguments": arguments}


# --- preprocessing -----------------------------------------------------------------------------
def _preprocess(messages: list[Message]) -> list[Message]:
    """Tool messages become user turns with a tool_result block; a user or tool message after a
    user turn merges into it; tool results are re-sorted into the preceding calls' order."""
    merged: list[Message] = []
    for m in messages:
        if m.role == "tool":
            block = Block(kind="tool_result", tool_use_id=m.tool_call_id, parts=[(PART_CLIENT, m.content)])
            if merged and merged[-1].role == "user":
                merged[-1].blocks.append(block)  # type: ignore[union-attr]
            else:
                merged.append(Message(role="user", blocks=[block]))
        elif m.role == "user":
            blocks = list(m.blocks) if m.blocks is not None else [Block(kind="text", text=m.content)]
            if merged and merged[-1].role == "user":
                merged[-1].blocks.extend(blocks)  # type: ignore[union-attr]
            else:
                merged.append(Message(role="user", blocks=blocks))
        else:
            merged.append(m)
    order: dict[str, int] = {}
    for m in merged:
        if m.role == "assistant" and m.tool_calls:
            order = {tc.id: k for k, tc in enumerate(m.tool_calls) if tc.id}
        elif m.role == "user" and m.blocks and order:
            results = [b for b in m.blocks if b.kind == "tool_result"]
            if len(results) > 1:
                it = iter(sorted(results, key=lambda b: order.get(b.tool_use_id, 0)))
                m.blocks = [next(it) if b.kind == "tool_result" else b for b in m.blocks]
    return merged


def _last_user_index(messages: list[Message]) -> int:
    for idx in range(len(messages) - 1, -1, -1):
        role = messages[idx].role
        if role in ("user", "developer") or (role == "system" and idx > 0):
            return idx
    return -1


def _drop_thinking(messages: list[Message]) -> list[Message]:
    last_user = _last_user_index(messages)
    out: list[Message] = []
    for idx, m in enumerate(messages):
        if m.role in ("user", "system") or idx >= last_user:
            out.append(m)
        elif m.role == "assistant":
            out.append(m)  # its reasoning is not rendered (render_assistant checks the index)
        # developer turns before the last user turn are dropped
    return out


# --- rendering ------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class RenderCut:
    """Where an assistant turn's rendering starts: a later request whose conversation is the same
    up to and including this turn may take ``segments[:num_segments]`` and ``spans[:num_spans]``
    as they are and render from here (``render_from``, ``protocol/history_memo.py``).

    Recorded only where that holds whatever follows: the turn comes right after a user turn
    (nothing before it merges with or is re-sorted by what follows), the conversation has no
    developer turns (neither chat API converts into one), and in a prompt without tools in
    thinking mode (where the last user turn decides reasoning and headers) a user turn follows it
    (``render_from`` resumes only a request with a user turn after the cut too)."""

    message: Message  # the assistant message (its conversation index is found by identity)
    index: int  # among the preprocessed messages
    num_segments: int  # segments before it (the generation header in front of it included)
    num_spans: int  # spans before it


@dataclass(slots=True, frozen=True)
class Resume:
    """Render from a ``RenderCut`` of an earlier request: ``segments`` are its segments before the
    cut, ``conv_index`` is the cut turn's index in this request's ``conv.messages``."""

    segments: list[Segment]
    index: int
    conv_index: int


def render(conv: Conversation, end_think_id: int | None = None, eos_id: int | None = None,
           schema_text: SchemaText = tools_schema_text,
           spans: list[AssistantSpan] | None = None, cuts: list[RenderCut] | None = None) -> list[Segment]:
    """Segments of the whole prompt, BOS first, generation header last.

    ``end_think_id`` / ``eos_id`` are needed only to splice ledger ids (IDS segments);
    ``schema_text`` prints tool schemas (the protocol passes its ``ToolsTextCache.text``);
    ``spans``, when given, receives each assistant turn rendered from the client's view right
    after a generation header (the turns the ledger may replace, ``AssistantSpan``); ``cuts``
    receives the places a later request may resume from (``RenderCut``)."""
    out = _render(conv, end_think_id, eos_id, schema_text, spans, cuts, None)
    assert out is not None  # only a resumed render can decline
    return out


def render_from(resume: Resume, conv: Conversation, end_think_id: int | None, eos_id: int | None,
                schema_text: SchemaText, spans: list[AssistantSpan],
                cuts: list[RenderCut] | None = None) -> list[Segment] | None:
    """``render`` of ``conv`` whose messages up to ``resume``'s cut are those of the earlier
    request the cut comes from, rendering only the messages from the cut on (``spans`` holds the
    earlier request's spans before the cut): exactly the segments ``render`` gives, or None when
    this request cannot resume there (a prompt without tools in thinking mode whose last user turn
    lies before the cut: the generation header in front of the cut differs)."""
    return _render(conv, end_think_id, eos_id, schema_text, spans, cuts, resume)


def _render(conv: Conversation, end_think_id: int | None, eos_id: int | None, schema_text: SchemaText,
            spans: list[AssistantSpan] | None, cuts: list[RenderCut] | None,
            resume: Resume | None) -> list[Segment] | None:
    has_tools = bool(conv.tools or conv.tool_catalog)  # deferred tools count: they can be loaded
    drop = not has_tools
    thinking = conv.thinking
    if resume is None:
        msgs = _preprocess(conv.messages)
        needs_system = has_tools or conv.response_format is not None
        if needs_system and (not msgs or msgs[0].role != "system"):
            msgs.insert(0, Message(role="system", content=""))
        offset = 0
        out: list[Segment] = [(OURS, BOS)]
    else:  # the cut turn is an assistant turn after a user turn: nothing before it merges or moves
        msgs = _preprocess(conv.messages[resume.conv_index:])
        offset = resume.index
        out = list(resume.segments)
    if thinking and drop:
        msgs = _drop_thinking(msgs)
    # indices below are into ``msgs``; a resumed render's last user turn may lie before the cut
    # (-1), which compares with every index from the cut on as the whole render's index would
    last_user = _last_user_index(msgs)
    if resume is not None and thinking and drop and last_user < 0:
        return None
    record = cuts is not None and not any(m.role == "developer" for m in msgs)
    n = len(msgs)
    for i, m in enumerate(msgs):
        first = offset + i == 0
        if first and (thinking or m.role == "system"):
            out.append((OURS, SYSTEM))
        if first and thinking:
            out.append((OURS, EFFORT_TEMPLATE.format(conv.effort)))
        role = m.role
        if role == "system":
            if not first:
                out.append((OURS, SYSTEM))
            out.append((CLIENT, m.content))
            if first and has_tools:
                out.append((OURS, "\n\n" + TOOLS_HEAD))
                out.append((CLIENT, schema_text(conv.tools)))
                out.append((OURS, TOOLS_TAIL))
            if first and conv.response_format is not None:
                out.append((OURS, "\n\n" + RESPONSE_FORMAT_HEAD))
                out.append((CLIENT, to_json(conv.response_format)))
        elif role == "developer":
            out.append((OURS, USER))
            out.append((CLIENT, m.content))
        elif role == "user":
            out.append((OURS, USER))
            _render_user_blocks(m.blocks or [], conv.tool_catalog, schema_text, out)
        elif role == "assistant":
            with_reasoning = thinking and (not drop or i > last_user)
            start = len(out)
            if (record and not first and (i == 0 or msgs[i - 1].role == "user")
                    and not (thinking and drop and i > last_user)):
                assert cuts is not None
                cuts.append(RenderCut(m, offset + i, start, len(spans) if spans is not None else 0))
            _render_assistant(m, with_reasoning, out, end_think_id, eos_id)
            if (spans is not None and out[start][0] != IDS and out[start - 1][0] == OURS
                    and out[start - 1][1] in GENERATION_HEADERS):
                spans.append((start, len(out), m, with_reasoning))
        else:  # pragma: no cover - conversion never produces other roles
            raise AssertionError(f"unexpected role {role}")
        # generation header
        if i + 1 < n and msgs[i + 1].role != "assistant":
            continue
        is_last = i == n - 1
        if (role in ("user", "developer") or (role == "system" and not first)
                or (is_last and role in ("system", "assistant"))):
            open_think = thinking and (not drop or i >= last_user)
            out.append((OURS, ASSISTANT + (THINK if open_think else END_THINK)))
    return out


def _render_user_blocks(blocks: list[Block], catalog: dict[str, dict[str, Any]], schema_text: SchemaText,
                        out: list[Segment]) -> None:
    first = True
    for b in blocks:
        if not first:
            out.append((OURS, "\n\n"))
        first = False
        if b.kind == "text":
            out.append((CLIENT, b.text))
        elif b.kind == "tool_result":
            out.append((OURS, "<tool_result>"))
            first_part = True
            for kind, payload in b.parts:
                if not first_part:
                    out.append((OURS, "\n\n"))
                first_part = False
                if kind == PART_TOOL_REFS:
                    _render_tool_definitions(payload, catalog, schema_text, out)
                else:
                    out.append((CLIENT, payload))
            out.append((OURS, "</tool_result>"))
        else:  # a placeholder ("[Unsupported <type>]"): client text, it holds the client's type
            out.append((CLIENT, b.text))


def _render_tool_definitions(names: tuple[str, ...], catalog: dict[str, dict[str, Any]],
                             schema_text: SchemaText,
                             out: list[Segment]) -> None:
    """A run of tool references: each tool's schema line, as the tools block prints it."""
    out.append((OURS, FUNCTIONS_OPEN))
    for name in names:
        out.append((OURS, FUNCTION_OPEN))
        out.append((CLIENT, schema_text([catalog[name]])))
        out.append((OURS, FUNCTION_CLOSE))
    out.append((OURS, FUNCTIONS_CLOSE))


def _render_assistant(
    m: Message, with_reasoning: bool, out: list[Segment], end_think_id: int | None, eos_id: int | None
) -> None:
    entry = m.ledger_entry
    if entry is not None and end_think_id is not None and eos_id is not None:
        ids = entry.render_ids(with_reasoning, end_think_id, eos_id)
        if ids is not None:
            out.append((IDS, ids))
            return
    if with_reasoning:
        out.append((CLIENT, m.reasoning or ""))
        out.append((OURS, END_THINK))
    out.append((CLIENT, m.content))
    if m.tool_calls:
        out.append((OURS, f"\n\n<{DSML} calls>\n"))
        for k, tc in enumerate(m.tool_calls):
            if k:
                out.append((OURS, "\n"))
            _render_call(tc, out)
        out.append((OURS, f"\n</{DSML} calls>"))
    out.append((OURS, EOS))


def _render_call(tc: ToolCall, out: list[Segment]) -> None:
    out.append((OURS, f'<{DSML} invoke name="'))
    out.append((CLIENT, tc.name))
    out.append((OURS, '">\n'))
    for k, (key, value) in enumerate(arguments_dict(tc.arguments).items()):
        is_str = isinstance(value, str)
        out.append((OURS, f'\n<{DSML} parameter name="' if k else f'<{DSML} parameter name="'))
        out.append((CLIENT, str(key)))
        out.append((OURS, '" string="true">' if is_str else '" string="false">'))
        out.append((CLIENT, value if is_str else to_json(value)))
        out.append((OURS, f"</{DSML} parameter>"))
    out.append((OURS, f"\n</{DSML} invoke>"))


def segments_text(segments: list[Segment]) -> str:
    """The prompt as one string (IDS segments are not representable and raise)."""
    parts: list[str] = []
    for kind, payload in segments:
        if kind == IDS:
            raise ValueError("ledger ids have no text form")
        parts.append(payload)
    return "".join(parts)
