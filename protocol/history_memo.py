"""A caller's earlier requests, kept so that a session's next turn validates, converts and renders
only its new messages.

A coding agent re-sends its whole history every turn: a 474K-token session is a 2 MB body of
~1,200 messages, of which one assistant turn and one tool result are new. Validating, depth
checking, converting and rendering all of it again costs more than tokenizing the new part. So
each prepared request leaves a ``History``: its wire messages as parsed, their conversion, its
rendered segments and spans, and the places a later request may resume rendering from
(``RenderCut``: each assistant turn right after a user turn). The next request of the same
caller compares its wire messages with the kept ones in order (``==`` on the parsed values: C
work, a memcmp of each string), takes the last cut inside the equal prefix, and does only the
messages from that cut on: depth check, pydantic validation, conversion and rendering. What
lies outside the messages (system text, tools, modes) is converted anew every time and must
equal the kept request's (``context``), else nothing is reused.

Exactness: the messages before the cut are equal values, so their depth check, validation and
conversion give what they gave before; the segments before the cut are what a whole render gives
(``render_from`` says when that holds and declines otherwise); tests compare incremental and
whole preparation on random histories. The output ledger and the prompt chunk cache are
unaffected: every assistant turn is still asked of the ledger under its binding, and the ids of
the whole prompt come from ``encode_bound`` as before (a segment taken from a kept render is the
same object, so the chunk cache's compare finds it at once).

Isolation: histories are found by the caller scope (``server/auth.caller_scope``), the API and
the session header, never across callers, so how fast a request is prepared never tells one
caller what another sent. A kept value is never changed: a wire message object that is the very
object kept (a caller re-sending a dict it may have changed in place) ends the equal prefix.

Bounded: ``per_key`` histories per key (most recent first) and ``max_bytes`` in all (the text
held, roughly), least recently used key out first. Thread-safe: histories are immutable once
kept; a request reads them and keeps its own when it is prepared.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from protocol.conversation import PART_TOOL_REFS, Message
from protocol.render import IDS, AssistantSpan, RenderCut, Segment

_SEGMENT_OVERHEAD_BYTES = 72  # a (kind, payload) tuple and its list slot
_MESSAGE_OVERHEAD_BYTES = 600  # a wire message's dicts and its converted Message, roughly


@dataclass(slots=True, frozen=True, eq=False, repr=False)
class History:
    """One prepared request's conversation, kept for the session's next turn."""

    context: tuple[Any, ...]  # what conversion and rendering take from outside the messages
    raw: list[Any]  # the wire messages as parsed
    messages: list[Message]  # the conversation's messages
    head: int  # conversation messages before wire message 0 (a system message)
    loaded: list[tuple[int, str]]  # (wire index, tool name) of each tool's first reference, in order
    segments: list[Segment]
    spans: list[AssistantSpan]
    cuts: list[tuple[int, RenderCut, int]]  # (wire index of the turn, the cut, bytes before it)
    nbytes: int


@dataclass(slots=True, frozen=True, repr=False)
class Reuse:
    """A kept history a request extends: wire messages before ``wire_index`` (the cut turn's) are
    the kept ones; from there on the request is prepared anew."""

    history: History
    wire_index: int
    cut: RenderCut
    nbytes: int  # of the kept part

    def messages(self) -> list[Message]:
        return self.history.messages[: self.history.head + self.wire_index]

    def loaded(self) -> list[tuple[int, str]]:
        return [(k, name) for k, name in self.history.loaded if k < self.wire_index]

    def segments(self) -> list[Segment]:
        return self.history.segments[: self.cut.num_segments]

    def spans(self) -> list[AssistantSpan]:
        return self.history.spans[: self.cut.num_spans]

    def cuts(self) -> list[tuple[int, RenderCut, int]]:
        return [c for c in self.history.cuts if c[0] < self.wire_index]


def common_prefix(old: list[Any], new: list[Any]) -> int:
    """How many leading values of ``new`` equal ``old``'s (an identical object ends it: it may
    have been changed in place since it was kept)."""
    n = min(len(old), len(new))
    for k in range(n):
        a, b = old[k], new[k]
        if a is b or a != b:
            return k
    return n


def tool_refs(messages: list[Message], first_index: int, seen: set[str]) -> list[tuple[int, str]]:
    """(wire index, name) of each tool reference in ``messages`` whose name is not in ``seen``
    yet, in the order conversion loads them (``seen`` is updated)."""
    out: list[tuple[int, str]] = []
    for k, m in enumerate(messages, first_index):
        for b in m.blocks or ():
            for kind, payload in b.parts:
                if kind == PART_TOOL_REFS:
                    for name in payload:
                        if name not in seen:
                            seen.add(name)
                            out.append((k, name))
    return out


def segment_bytes(segments: list[Segment], start: int) -> int:
    return sum(len(p) + _SEGMENT_OVERHEAD_BYTES if kind != IDS else _SEGMENT_OVERHEAD_BYTES
               for kind, p in segments[start:])


def build_history(context: tuple[Any, ...], raw: list[Any], messages: list[Message], head: int,
                  loaded: list[tuple[int, str]], segments: list[Segment], spans: list[AssistantSpan],
                  cuts: list[RenderCut], reuse: Reuse | None) -> History:
    """The history of a request prepared from ``reuse`` (or from scratch): ``cuts`` are the cuts
    its own render recorded (from the resumed cut on); the kept part's cuts carry over."""
    kept = reuse.cuts() if reuse is not None else []
    base_bytes = reuse.nbytes if reuse is not None else 0
    base_segments = reuse.cut.num_segments if reuse is not None else 0
    first_new = reuse.wire_index if reuse is not None else 0
    wire_of = {id(m): k - head for k, m in enumerate(messages[head + first_new:], head + first_new)}
    new_cuts = [c for c in cuts if id(c.message) in wire_of]
    running = base_bytes
    pos = base_segments
    out = list(kept)
    for c in new_cuts:
        running += segment_bytes(segments[pos:c.num_segments], 0)
        pos = c.num_segments
        out.append((wire_of[id(c.message)], c, running))
    nbytes = running + segment_bytes(segments, pos) + _MESSAGE_OVERHEAD_BYTES * (len(raw) - first_new)
    return History(context, raw, messages, head, loaded, segments, spans, out, nbytes)


class HistoryMemo:
    """Kept histories by key (module docstring)."""

    def __init__(self, max_bytes: int = 256 << 20, per_key: int = 4) -> None:
        if max_bytes < 0 or per_key < 1:
            raise ValueError("max_bytes must be >= 0 and per_key >= 1")
        self.max_bytes = max_bytes
        self.per_key = per_key
        self.num_bytes = 0
        self.num_reused = 0  # requests that resumed from a kept history
        self.reused_messages = 0  # wire messages they did not prepare again
        self._keys: OrderedDict[Hashable, list[History]] = OrderedDict()
        self._lock = threading.Lock()

    def find(self, key: Hashable, raw: list[Any]) -> Reuse | None:
        """The kept history under ``key`` sharing the longest resumable prefix with ``raw``."""
        with self._lock:
            candidates = list(self._keys.get(key, ()))
            if candidates:
                self._keys.move_to_end(key)
        best: Reuse | None = None
        for history in candidates:
            if not history.cuts or not raw or history.raw[0] != raw[0]:
                continue
            same = common_prefix(history.raw, raw)
            # the last cut whose turn lies inside the equal prefix
            k = bisect.bisect_left(history.cuts, same, key=lambda c: c[0]) - 1
            if k < 0:
                continue
            wire_index, cut, nbytes = history.cuts[k]
            if best is None or wire_index > best.wire_index:
                best = Reuse(history, wire_index, cut, nbytes)
        return best

    def keep(self, key: Hashable, history: History, extended: History | None) -> None:
        """Keep ``history`` under ``key`` (first), in place of the history it ``extended``."""
        if history.nbytes > self.max_bytes or not history.cuts:
            return
        with self._lock:
            histories = self._keys.pop(key, [])
            for k, h in enumerate(histories):
                if h is extended:
                    del histories[k]
                    self.num_bytes -= h.nbytes
                    break
            histories.insert(0, history)
            self.num_bytes += history.nbytes
            for dropped in histories[self.per_key:]:
                self.num_bytes -= dropped.nbytes
            del histories[self.per_key:]
            self._keys[key] = histories
            while self.num_bytes > self.max_bytes and self._keys:
                _, dropped_all = self._keys.popitem(last=False)
                self.num_bytes -= sum(h.nbytes for h in dropped_all)

    def count(self, reuse: Reuse) -> None:
        with self._lock:
            self.num_reused += 1
            self.reused_messages += reuse.wire_index

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()
            self.num_bytes = 0
