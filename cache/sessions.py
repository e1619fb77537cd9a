"""Sessions: which conversation a turn belongs to, where it lives, and when it will be back.

A session is the unit the cache routes, evicts and moves. It is recognised by the client's
``X-Claude-Code-Session-Id`` header (the *hint*) when there is one, otherwise by its prompt
extending the last turn of a known session (the tail hash of that turn appears in the new
prompt's chain). Turns that match neither start a new anonymous session.

Return-time model (what eviction weighs): a session that just ended a turn with a tool call is
waiting on a tool (next turn in seconds: p50 9 s, p90 74 s in Claude Code traces,
``../shared/reference/agent-workload.md``); one that ended its turn is waiting on a person
(p50 ~90-130 s, heavy tail). Each session learns its own gaps per stop kind (EWMA seeded by the
fleet-wide EWMA, which is seeded by those medians). ``expected_wait_s`` is the time we expect
until the session's next turn; past its expected gap the wait grows with the idle time (a
heavy-tailed gap that has already lasted t is likely to last about t more), so stale sessions
sink in value without a hard TTL.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from rank.ids import BlockHash, Rank, SessionId

__all__ = ["GapModel", "Session", "SessionId", "SessionTable", "StopKind", "session_id_for_hint"]

_HINT_PREFIX = "hint:"


def session_id_for_hint(hint: str) -> SessionId:
    """The session id of a client's session hint (its session header). Sessions without a hint
    get ``anon:<n>`` ids, so a hint can never collide with one."""
    return SessionId(_HINT_PREFIX + hint)


class StopKind(str, enum.Enum):
    """Why the last turn ended, as the protocol layer saw it."""

    TOOL_USE = "tool_use"  # the model called a tool: the client comes back with its result
    END_TURN = "end_turn"  # the model answered: a person reads it and types the next prompt
    UNKNOWN = "unknown"  # length cut, error, abort, or not reported


# Priors from agent-workload.md (client gap after a tool call p50 9 s; human think time p50 86-127 s).
DEFAULT_TOOL_GAP_S = 9.0
DEFAULT_HUMAN_GAP_S = 120.0
_GAP_EWMA_ALPHA = 0.3
_MAX_GAP_S = 6 * 3600.0  # a gap longer than this is a new working day, not a sample


@dataclass(slots=True)
class GapModel:
    """EWMA of inter-turn gaps per stop kind (seconds)."""

    tool_gap_s: float = DEFAULT_TOOL_GAP_S
    human_gap_s: float = DEFAULT_HUMAN_GAP_S
    num_samples: int = 0

    def expected_gap_s(self, kind: StopKind) -> float:
        if kind is StopKind.TOOL_USE:
            return self.tool_gap_s
        if kind is StopKind.END_TURN:
            return self.human_gap_s
        return 0.5 * (self.tool_gap_s + self.human_gap_s)

    def observe(self, kind: StopKind, gap_s: float) -> None:
        if not 0.0 <= gap_s <= _MAX_GAP_S or kind is StopKind.UNKNOWN:
            return
        self.num_samples += 1
        if kind is StopKind.TOOL_USE:
            self.tool_gap_s += _GAP_EWMA_ALPHA * (gap_s - self.tool_gap_s)
        else:
            self.human_gap_s += _GAP_EWMA_ALPHA * (gap_s - self.human_gap_s)


@dataclass(slots=True, eq=False)
class Session:
    """One conversation. ``home_rank`` is where its turns go (sticky); ``None`` until its first
    admission. ``num_in_flight`` counts its admitted, unfinished turns (a session with one in
    flight is never moved). ``tail_hashes`` are the chain hashes its last turns ended on (how a
    hint-less continuation is recognised)."""

    session_id: SessionId
    home_rank: Rank | None = None
    num_in_flight: int = 0
    last_stop: StopKind = StopKind.UNKNOWN
    last_finish_s: float | None = None  # end of its last turn; None while it never finished one
    last_seen_s: float = 0.0
    moved_at_s: float = float("-inf")
    context_tokens: int = 0  # prompt + output tokens of its last turn
    gaps: GapModel = field(default_factory=GapModel)
    tail_hashes: list[BlockHash] = field(default_factory=list)

    def expected_wait_s(self, now_s: float) -> float:
        """Seconds until we expect this session's next turn (0 while a turn is in flight)."""
        if self.num_in_flight > 0 or self.last_finish_s is None:
            return 0.0
        idle_s = max(0.0, now_s - self.last_finish_s)
        gap_s = self.gaps.expected_gap_s(self.last_stop)
        return max(gap_s - idle_s, idle_s)


class SessionTable:
    """All known sessions, by id and by tail hash.

    Invariant: ``_by_tail[h] is s`` implies ``h in s.tail_hashes``; each session keeps at most
    ``max_tails`` tails (its newest turns), so a session with parallel branches (subagents under
    one header) is still recognised on each branch.
    """

    def __init__(self, max_tails: int = 4) -> None:
        self._sessions: dict[SessionId, Session] = {}
        self._by_tail: dict[BlockHash, Session] = {}
        self._anon_ids = itertools.count(1)
        self.fleet_gaps = GapModel()
        self._max_tails = max_tails

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions.values())

    def get(self, session_id: SessionId) -> Session | None:
        return self._sessions.get(session_id)

    def find(self, hint: str | None, prompt_hashes: list[BlockHash]) -> Session | None:
        """The session a prompt belongs to: by hint first, else by the deepest tail it extends."""
        if hint:
            # The header is authoritative: a new id is a new session even if its prompt extends
            # another one's (routing still sends it to the rank with that prefix, by cost).
            return self._sessions.get(session_id_for_hint(hint))
        by_tail = self._by_tail
        for h in reversed(prompt_hashes):
            session = by_tail.get(h)
            if session is not None:
                return session
        return None

    def create(self, hint: str | None, now_s: float) -> Session:
        sid = session_id_for_hint(hint) if hint else SessionId(f"anon:{next(self._anon_ids)}")
        assert sid not in self._sessions, sid
        gaps = GapModel(self.fleet_gaps.tool_gap_s, self.fleet_gaps.human_gap_s)
        session = Session(session_id=sid, last_seen_s=now_s, gaps=gaps)
        self._sessions[sid] = session
        return session

    def record_arrival(self, session: Session, now_s: float) -> None:
        """A new turn of ``session`` arrived: learn the gap since its last turn ended."""
        if session.last_finish_s is not None and session.num_in_flight == 0:
            gap_s = now_s - session.last_finish_s
            session.gaps.observe(session.last_stop, gap_s)
            self.fleet_gaps.observe(session.last_stop, gap_s)
        session.last_seen_s = now_s

    def record_finish(
        self, session: Session, stop: StopKind, tail: BlockHash | None, context_tokens: int, now_s: float
    ) -> None:
        session.last_stop = stop
        session.last_finish_s = now_s
        session.last_seen_s = now_s
        session.context_tokens = context_tokens
        if tail is None:
            return
        owner = self._by_tail.get(tail)
        if owner is not None and owner is not session:
            owner.tail_hashes.remove(tail)
        if tail in session.tail_hashes:
            session.tail_hashes.remove(tail)
        session.tail_hashes.append(tail)
        self._by_tail[tail] = session
        while len(session.tail_hashes) > self._max_tails:
            del self._by_tail[session.tail_hashes.pop(0)]

    def forget_idle(self, now_s: float, idle_s: float, keep: set[SessionId]) -> list[SessionId]:
        """Drop sessions idle longer than ``idle_s`` that hold nothing (ids in ``keep`` stay)."""
        dropped = [
            s.session_id
            for s in self._sessions.values()
            if s.num_in_flight == 0 and now_s - s.last_seen_s > idle_s and s.session_id not in keep
        ]
        for sid in dropped:
            session = self._sessions.pop(sid)
            for h in session.tail_hashes:
                if self._by_tail.get(h) is session:
                    del self._by_tail[h]
        return dropped

    def clear_placement(self) -> None:
        """After a rank restart: every session keeps its gap model but loses its rank and tails."""
        self._by_tail.clear()
        for s in self._sessions.values():
            s.home_rank = None
            s.tail_hashes.clear()
