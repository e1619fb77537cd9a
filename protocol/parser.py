"""Streaming parser: detokenized output text (with control sentinels) -> events.

Events are tuples, cheap on the hot path:

* ``(REASONING, text)``: reasoning delta (inside ``<think>``...``</think>``).
* ``(TEXT, text)``: content delta.
* ``(TOOL_START, (index, name))``: a tool call begins (its name is known).
* ``(TOOL_ARGS, text)``: the next piece of the current call's arguments JSON.
* ``(TOOL, ParsedCall)``: the call is complete; the ``TOOL_ARGS`` since its ``TOOL_START``
  join to exactly ``ParsedCall.arguments_json`` (see parser_args.py for what streams when).

Behaviour (as vLLM's V4.1 parser, ``vllm/parser/deepseek_v41.py``, handles it):

1. Holds back any suffix that may begin a tag (``<`` before ``｜DSML｜``, trailing whitespace
   before a block), so every split of the output gives the same events (merged per kind).
2. A redundant ``<think>`` or a stray ``</think>`` is absorbed.
3. A DSML block opening inside reasoning ends the reasoning and is parsed as calls.
   When a DSML token opens a block: ``<｜DSML｜ calls>`` (the control token between ``<`` and
   `` calls>``) opens one wherever it stands, but only if the next non-whitespace is an
   ``<｜DSML｜ invoke`` or the block's close; otherwise the tag and what follows stay visible
   text. Inside a block, anything but whitespace and invokes ends the block and is visible text
   (text is never dropped; only markup is: an unclosed block or a partial tag at the end).
4. Whitespace before a block (the ``\\n\\n`` separator) is never emitted; whitespace-only content
   is never emitted (no whitespace-only Anthropic text block).
5./6./7. Parameters: ``string="true"`` raw text; ``string="false"`` JSON, kept as a string when
   invalid or non-finite (``NaN``, ``1e999``); missing ``string``: JSON if valid, else string;
   a missing ``</｜DSML｜ parameter>`` before the next parameter is tolerated; duplicate
   parameters keep the first.
8. Wrapper collapse: a lone ``arguments``/``input`` parameter that is not declared, whose
   object keys are all declared, is unwrapped.
9. An ``invoke`` without the ``calls`` wrapper is recovered only for a declared tool name and
   only once its ``</｜DSML｜ invoke>`` arrived; otherwise it stays text. ASCII look-alikes
   (``|DSML|`` spelled with BPE pieces) are never tags: tags are control *tokens*.
10. A call is complete when its invoke closes; an unterminated invoke (max_tokens, EOS) never
   becomes a ``TOOL`` event (nor ``{}``): its streamed start and arguments stay an unfinished
   call (``num_cut_calls``), which the emitters close as incomplete.
11. Text after ``</｜DSML｜ calls>`` is kept as content (a new text run).
12. With tools disabled (no tools, ``tool_choice: none``), blocks are parsed and suppressed.
A call to a tool the request did not declare (inside a calls block) is passed through as a
call: the client answers it with its own "no such tool" result, as for any bad call. The V4
spelling (``tool_calls``, no space before ``invoke``/``parameter``) and V3.2 ``function_calls``
are accepted.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from protocol.detokenize import S_DSML, S_END_THINK, S_EOS, S_THINK, SENTINEL_TEXT
from protocol.parser_args import ArgStreamer, args_json, clean_value, param_value, restore_text

__all__ = ["REASONING", "TEXT", "TOOL", "TOOL_START", "TOOL_ARGS", "Event", "EventKind", "ParsedCall",
           "StreamParser", "restore_text"]


class EventKind(enum.IntEnum):
    """What a parser event ``(kind, payload)`` carries (the module docstring has the order)."""

    REASONING = 0  # str: reasoning text
    TEXT = 1  # str: content text
    TOOL = 2  # ParsedCall: the call is complete
    TOOL_START = 3  # (index, name): a tool call begins (its name is known)
    TOOL_ARGS = 4  # str: the next piece of the current call's arguments JSON


REASONING, TEXT, TOOL, TOOL_START, TOOL_ARGS = EventKind
Event = tuple[EventKind, Any]

_ST_REASONING = 0
_ST_CONTENT = 1
_ST_BLOCK = 2
_ST_END = 3

_SENTINEL_RE = re.compile(f"[{S_THINK}{S_END_THINK}{S_DSML}{S_EOS}]")
_WS = " \t\r\n"
_BLOCK_TAILS = (" calls>", "calls>", " tool_calls>", "tool_calls>", " function_calls>", "function_calls>")
_INVOKE_TAILS = (" invoke", "invoke")
_CLOSE_CALLS = tuple("</" + S_DSML + t for t in _BLOCK_TAILS)
_OPEN_INVOKE = tuple("<" + S_DSML + t for t in _INVOKE_TAILS)
_CLOSE_INVOKE_RE = re.compile("</" + S_DSML + " ?invoke>")
_NAME_RE = re.compile(r'\s*name="([^"]*)"[^>]*>')
_PARAM_OPEN_RE = re.compile("<" + S_DSML + " ?parameter")
_PARAM_ATTR_RE = re.compile(r'\s*name="([^"]*)"(?:\s+string="([^"]*)")?[^>]*>')
_PARAM_CLOSE_RE = re.compile("</" + S_DSML + " ?parameter>")


@dataclass(slots=True)
class ParsedCall:
    index: int
    name: str
    arguments: dict[str, Any]
    arguments_json: str


class StreamParser:
    """One generation's parser. ``feed`` text as it is detokenized; ``finish`` at the end."""

    __slots__ = ("_buf", "_state", "_text_started", "_after_block", "_tool_params", "_tools_enabled",
                 "num_calls", "_bare",
                 "_args", "num_cut_calls", "num_arg_mismatches")

    def __init__(self, thinking: bool, tool_params: dict[str, frozenset[str]] | None = None,
                 tools_enabled: bool = True) -> None:
        self._buf = ""
        self._state = _ST_REASONING if thinking else _ST_CONTENT
        self._text_started = False
        self._after_block = False
        self._tool_params = tool_params or {}
        self._tools_enabled = tools_enabled
        self._bare = False  # inside a recovered invoke that had no calls wrapper
        self.num_calls = 0  # calls started (TOOL_START); the complete ones end with TOOL
        self._args: ArgStreamer | None = None  # the open invoke's argument streamer
        self.num_cut_calls = 0  # invokes left unterminated at the end
        self.num_arg_mismatches = 0  # streamed arguments not a prefix of the final JSON (a bug)

    @property
    def done(self) -> bool:
        return self._state == _ST_END

    def feed(self, text: str) -> list[Event]:
        if self._state == _ST_END or not text:
            return []
        self._buf += text
        events: list[Event] = []
        self._run(events, final=False)
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._state != _ST_END:
            self._run(events, final=True)
            self._state = _ST_END
        self._buf = ""
        return events

    # --- driver ---------------------------------------------------------------------------------
    def _run(self, events: list[Event], final: bool) -> None:
        while self._state != _ST_END:
            if self._state == _ST_BLOCK:
                progressed = self._scan_block(events, final)
            else:
                progressed = self._scan_text(events, final)
            if not progressed:
                return

    def _emit(self, events: list[Event], kind: EventKind, text: str) -> None:
        if not text:
            return
        if kind == TEXT:
            self._text_started = True
        if events and events[-1][0] == kind:
            events[-1] = (kind, events[-1][1] + text)
        else:
            events.append((kind, text))

    def _kind(self) -> EventKind:
        return REASONING if self._state == _ST_REASONING else TEXT

    def _emit_run(self, events: list[Event], text: str, final: bool) -> str:
        """Emit the safe part of ``text`` (no sentinel inside); return what must be held."""
        kind = self._kind()
        if final:
            if kind == TEXT:
                if self._after_block and not self._text_started:
                    text = text.lstrip(_WS)
                if not self._text_started and not text.strip(_WS):
                    return ""
            self._emit(events, kind, text)
            return ""
        # hold a trailing "<" (may open a DSML tag) and the whitespace before it / at the end
        cut = len(text)
        if cut and text[cut - 1] == "<":
            cut -= 1
        while cut and text[cut - 1] in _WS:
            cut -= 1
        head = text[:cut]
        if kind == TEXT and not self._text_started:
            if not head.strip(_WS):
                return text  # whitespace-only so far: hold all of it
            if self._after_block:
                head = head.lstrip(_WS)  # a text run after a block starts at its first non-space
        self._emit(events, kind, head)
        return text[cut:]

    # --- reasoning / content --------------------------------------------------------------------
    def _scan_text(self, events: list[Event], final: bool) -> bool:
        buf = self._buf
        m = _SENTINEL_RE.search(buf)
        if m is None:
            self._buf = self._emit_run(events, buf, final)
            return False
        i = m.start()
        s = buf[i]
        if s == S_THINK or (s == S_END_THINK and self._state == _ST_CONTENT):
            self._buf = buf[:i] + buf[i + 1 :]  # absorbed (2)
            return True
        if s == S_END_THINK:  # reasoning ends; its trailing whitespace is kept
            self._emit(events, REASONING, buf[:i])
            self._state = _ST_CONTENT
            self._buf = buf[i + 1 :]
            return True
        if s == S_EOS:
            self._emit_run(events, buf[:i], final=True)
            self._state = _ST_END
            self._buf = ""
            return False
        # S_DSML: a block opening, a bare invoke, or literal text
        lt = i - 1 if i > 0 and buf[i - 1] == "<" else -1
        rest = buf[i + 1 :]
        if lt >= 0:
            tail = next((t for t in _BLOCK_TAILS if rest.startswith(t)), None)
            opens = None if tail is None else _block_follows(rest[len(tail) :], final)
            if tail is not None and opens is None:  # undecided: hold the tag
                self._buf = self._emit_run(events, buf[:lt], final=False) + buf[lt:]
                return False
            if opens:
                self._emit_run(events, buf[:lt].rstrip(_WS), final=True)  # (3)(4)
                self._state = _ST_BLOCK
                self._bare = False
                self._buf = rest[len(tail) :]  # type: ignore[arg-type]
                return True
            if tail is not None:
                pass  # a calls tag not followed by an invoke: literal text (3)
            elif any(rest.startswith(t) for t in _INVOKE_TAILS) and self._tool_params:
                end = _CLOSE_INVOKE_RE.search(buf, i)
                if end is None and not final and S_EOS not in rest:
                    self._buf = self._emit_run(events, buf[:lt], final=False) + buf[lt:]
                    return False
                if end is not None:
                    call = self._parse_invoke(buf[i + 1 + len(_invoke_tail(rest)) : end.start()])
                    if call is not None and call[0] in self._tool_params:  # (9) declared names only
                        self._emit_run(events, buf[:lt].rstrip(_WS), final=True)
                        self._emit_call(events, call)
                        self._state = _ST_BLOCK
                        self._bare = True
                        self._buf = buf[end.end() :]
                        return True
            elif not final and any(t.startswith(rest) for t in _BLOCK_TAILS + _INVOKE_TAILS):
                self._buf = self._emit_run(events, buf[:lt], final=False) + buf[lt:]
                return False
        # not a tag: literal text up to and including the sentinel
        self._emit_run(events, buf[:i] + SENTINEL_TEXT[S_DSML], final=True)
        self._buf = buf[i + 1 :]
        return True

    # --- DSML block -------------------------------------------------------------------------------
    def _scan_block(self, events: list[Event], final: bool) -> bool:
        buf = self._buf
        eos = buf.find(S_EOS)
        if eos >= 0:
            buf = buf[:eos]
            final = True
        j = 0
        n = len(buf)
        while j < n and buf[j] in _WS:
            j += 1
        rest = buf[j:]
        for close in _CLOSE_CALLS:
            if rest.startswith(close):
                self._buf = rest[len(close) :] + (S_EOS if eos >= 0 else "")
                self._leave_block()
                return True
        for opener in _OPEN_INVOKE:
            if rest.startswith(opener):
                end = _CLOSE_INVOKE_RE.search(rest)
                if end is None:
                    if not self._bare:
                        self._stream_args(events, rest[len(opener) :])
                    if final:  # unterminated invoke: a cut call (10)
                        self.num_cut_calls += self._args is not None
                        self._args = None
                        self._state = _ST_END
                        self._buf = ""
                    else:
                        self._buf = rest
                    return False
                call = self._parse_invoke(rest[len(opener) : end.start()])
                if call is not None and (not self._bare or call[0] in self._tool_params):
                    self._emit_call(events, call)
                self._args = None
                self._buf = rest[end.end() :] + (S_EOS if eos >= 0 else "")
                return True
        if rest and any(c.startswith(rest) for c in _CLOSE_CALLS + _OPEN_INVOKE) or not rest:
            if final:  # an unclosed block or a partial tag: markup, nothing to show
                self._state = _ST_END
                self._buf = ""
            else:
                self._buf = rest
            return False
        # anything else (text after a recovered bare invoke, junk in a block) ends the block and
        # is visible text: never dropped (3)
        self._buf = rest + (S_EOS if eos >= 0 else "")
        self._leave_block()
        return True

    def _leave_block(self) -> None:
        self._state = _ST_CONTENT
        self._bare = False
        self._after_block = True
        self._text_started = False

    def _stream_args(self, events: list[Event], body: str) -> None:
        """An invoke still open: start its call once the name is known, stream its arguments."""
        if not self._tools_enabled:
            return  # (12) suppressed
        if self._args is None:
            m = _NAME_RE.match(body)
            name = restore_text(m.group(1)).strip() if m is not None else ""
            if not name:
                return
            self._args = ArgStreamer(self._tool_params.get(name))
            events.append((TOOL_START, (self.num_calls, name)))
            self.num_calls += 1
        m = _NAME_RE.match(body)
        assert m is not None
        self._emit(events, TOOL_ARGS, self._args.advance(body[m.end() :]))

    def _emit_call(self, events: list[Event], call: tuple[str, dict[str, Any]]) -> None:
        if not self._tools_enabled:
            return  # (12) suppressed
        name, args = call
        final = args_json(args)
        streamer = self._args
        if streamer is None:
            index = self.num_calls
            self.num_calls += 1
            events.append((TOOL_START, (index, name)))
            rest = final
        else:
            index = self.num_calls - 1
            rest, ok = streamer.close(final)
            if not ok:
                self.num_arg_mismatches += 1
        self._emit(events, TOOL_ARGS, rest)
        events.append((TOOL, ParsedCall(index, name, args, final)))

    def _parse_invoke(self, body: str) -> tuple[str, dict[str, Any]] | None:
        m = _NAME_RE.match(body)
        if m is None:
            return None
        name = restore_text(m.group(1)).strip()
        if not name:
            return None
        pos = m.end()
        args: dict[str, Any] = {}
        while True:
            po = _PARAM_OPEN_RE.search(body, pos)
            if po is None:
                break
            am = _PARAM_ATTR_RE.match(body, po.end())
            if am is None:
                pos = po.end()
                continue
            vstart = am.end()
            pc = _PARAM_CLOSE_RE.search(body, vstart)
            nxt = _PARAM_OPEN_RE.search(body, vstart)
            if pc is not None and (nxt is None or pc.start() < nxt.start()):
                raw, pos = body[vstart : pc.start()], pc.end()
            elif nxt is not None:  # missing close before the next parameter (7)
                raw, pos = body[vstart : nxt.start()].rstrip("\n"), nxt.start()
            else:  # missing close before </invoke>
                raw, pos = body[vstart:].rstrip("\n"), len(body)
            key = restore_text(am.group(1))
            if key in args:
                continue  # duplicate parameter: first wins
            args[key] = param_value(clean_value(raw), am.group(2))
        return name, self._collapse(name, args)

    def _collapse(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        declared = self._tool_params.get(name)
        if not declared or len(args) != 1:
            return args
        (key, value), = args.items()
        if (key in ("arguments", "input") and key not in declared and isinstance(value, dict)
                and set(value) <= declared):
            return value
        return args


def _block_follows(after: str, final: bool) -> bool | None:
    """Does a ``<｜DSML｜ calls>`` tag followed by ``after`` open a block? None: not known yet."""
    cut = after.find(S_EOS)
    if cut >= 0:
        after, final = after[:cut], True
    rest = after.lstrip(_WS)
    if any(rest.startswith(t) for t in _OPEN_INVOKE + _CLOSE_CALLS):
        return True
    if not rest or any(t.startswith(rest) for t in _OPEN_INVOKE + _CLOSE_CALLS):
        return True if final else None  # at the end: an empty or cut block (markup only)
    return False


def _invoke_tail(rest: str) -> str:
    for t in _INVOKE_TAILS:
        if rest.startswith(t):
            return t
    return ""
