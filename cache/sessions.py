"""Sessions: which conversation a turn belongs to, where it lives, and when it will be back.

A session is the unit the cache routes, evicts and moves. It is recognised by the client's
``X-Claude-Code-Session-Id`` header (the *hint*) when there is one, otherwise by its prompt
extending the last turn of a known session (the tail hash of that turn appears in the new
prompt's chain). Turns that match neither start a new anonymous session.

Branches: a session is not always one line of turns. Claude Code runs subagents (1-4 at once,
each a fresh context) under its parent's session header. Each *branch* is its own routing unit
(its own ``Session``, with ``family`` naming the main session): keyed by the client's agent id
when it sends one (``SessionHint.agent_id``: ``x-claude-code-agent-id``), else detected from the
prompts (``SessionTable.resolve``): a turn under a known header that extends none of the
family's tails while the family has a turn in flight or the main thread is waiting on a tool is
a new branch. Auxiliary requests (titles, memory passes) get a session of their own that never
pins a rank (``cache/router.py``). ``docs/cache.md`` ("Routing rules") has the rules.

Return-time model (what eviction weighs): a session that just ended a turn with a tool call is
waiting on a tool (next turn in seconds: p50 9 s, p90 74 s in Claude Code traces,
the public agent traces in ``docs/loadtest.md``); one that ended its turn is waiting on a person
(p50 ~90-130 s, heavy tail). Each session learns its own gaps per stop kind (EWMA seeded by the
fleet-wide EWMA, which is seeded by those medians). ``expected_wait_s`` is the time we expect
until the session's next turn; past its expected gap the wait grows with the idle time (a
heavy-tailed gap that has already lasted t is likely to last about t more), so stale sessions
sink in value without a hard TTL.

``SessionTable`` owns every session's fields and the router's idle-load term (``idle``,
``cache/idle_load.py``), which depends on them: each method that changes a session's home rank,
turns in flight, last finish, gaps or context recounts it there, so no caller can forget to
(``tests/test_structure.py`` keeps the fields' writes in this module).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from cache.idle_load import IdleLoad
from rank.ids import BlockHash, Rank, SessionId

__all__ = ["GapModel", "RequestClass", "Session", "SessionHint", "SessionId", "SessionTable", "StopKind",
           "session_id_for_hint"]

_HINT_PREFIX = "hint:"


class RequestClass(str, enum.Enum):
    """What a request is to its client's session (Claude Code's ``x-claude-code-request-class``
    and friends; ``server/agent_hints.py`` reads them)."""

    MAIN = "main"  # the main thread's turn
    SUBAGENT = "subagent"  # a turn of a subagent (a branch with a fresh context)
    COMPACTION = "compaction"  # the summary request: the session's prefix is about to be replaced
    AUXILIARY = "auxiliary"  # a short one-off beside the session (title, summary, memory pass)


@dataclass(frozen=True, slots=True)
class SessionHint:
    """What the client says about a request's place in its session: the session key and, where
    the client sends them, the agent and request-class headers. ``key`` None: no session key."""

    key: str | None = None
    agent_id: str | None = None
    parent_agent_id: str | None = None
    agent_type: str | None = None
    request_class: RequestClass = RequestClass.MAIN
    prompt_id: str | None = None
    context_compacted: bool = False  # the first turn after a compaction (its new prefix)
    auxiliary_type: str | None = None

    @staticmethod
    def of(hint: SessionHint | str | None) -> SessionHint:
        """A plain session key (callers without agent headers) as a hint."""
        if isinstance(hint, SessionHint):
            return hint
        return SessionHint(key=hint or None)

    @property
    def is_auxiliary(self) -> bool:
        return self.request_class is RequestClass.AUXILIARY


def session_id_for_hint(hint: SessionHint | str) -> SessionId:
    """The session id of a client's session hint (its session header and, for a subagent or an
    auxiliary request, the branch it names). Sessions without a hint get ``anon:<n>`` ids, so a
    hint can never collide with one. The one place a hint becomes an id."""
    h = SessionHint.of(hint)
    base = _HINT_PREFIX + (h.key or "")
    if h.request_class is RequestClass.AUXILIARY:
        return SessionId(f"{base}/aux:{h.auxiliary_type or h.agent_id or 'auxiliary'}")
    if h.agent_id:
        return SessionId(f"{base}/agent:{h.agent_id}")
    return SessionId(base)


def _family_id(session_id: SessionId) -> SessionId:
    return SessionId(session_id.split("/", 1)[0])


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
    first_prompt_tokens: int = 0  # prompt tokens of its first turn
    gaps: GapModel = field(default_factory=GapModel)
    tail_hashes: list[BlockHash] = field(default_factory=list)
    # The main session of a branch's family (itself for a main session; None without a hint).
    family: SessionId | None = None
    request_class: RequestClass = RequestClass.MAIN  # MAIN, SUBAGENT (a branch) or AUXILIARY
    # A compaction request ran: its next main turn retires the old prefix (``take_retired``).
    compacting: bool = False

    def expected_wait_s(self, now_s: float) -> float:
        """Seconds until we expect this session's next turn (0 while a turn is in flight)."""
        if self.num_in_flight > 0 or self.last_finish_s is None:
            return 0.0
        idle_s = max(0.0, now_s - self.last_finish_s)
        gap_s = self.expected_gap_s()
        return max(gap_s - idle_s, idle_s)

    def expected_gap_s(self) -> float:
        """The expected gap after its last turn. A subagent whose turn ended with an answer
        has reported to its parent and is done: no next turn is expected (its blocks go before
        any waiting session's, and it stops counting toward its rank's idle load)."""
        if self.request_class is RequestClass.SUBAGENT and self.last_stop is StopKind.END_TURN:
            return _MAX_GAP_S
        return self.gaps.expected_gap_s(self.last_stop)


class SessionTable:
    """All known sessions, by id and by tail hash.

    Invariant: ``_by_tail[h] is s`` implies ``h in s.tail_hashes``; each session keeps at most
    ``max_tails`` tails (its newest turns), so a session with parallel branches (subagents under
    one header) is still recognised on each branch.
    """

    def __init__(self, max_tails: int = 4, *, num_ranks: int = 1, home_horizon_s: float = 900.0) -> None:
        self._sessions: dict[SessionId, Session] = {}
        self._by_tail: dict[BlockHash, Session] = {}
        self._anon_ids = itertools.count(1)
        self._branch_ids = itertools.count(1)
        self._families: dict[SessionId, list[Session]] = {}  # main id -> its branches
        self.fleet_gaps = GapModel()
        self._max_tails = max_tails
        # The router's idle-token term (``home_horizon_s``: ``CacheConfig``), kept by the methods below.
        self.idle = IdleLoad(num_ranks, home_horizon_s, self)

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions.values())

    def get(self, session_id: SessionId) -> Session | None:
        return self._sessions.get(session_id)

    def find(self, hint: SessionHint | str | None, prompt_hashes: list[BlockHash]) -> Session | None:
        """The session a prompt belongs to: by hint first, else by the deepest tail it extends."""
        h = SessionHint.of(hint)
        if h.key:
            # The header is authoritative: a new id is a new session even if its prompt extends
            # another one's (routing still sends it to the rank with that prefix, by cost).
            return self._sessions.get(session_id_for_hint(h))
        by_tail = self._by_tail
        for bh in reversed(prompt_hashes):
            session = by_tail.get(bh)
            if session is not None:
                return session
        return None

    def create(self, hint: SessionHint | str | None, now_s: float) -> Session:
        h = SessionHint.of(hint)
        sid = session_id_for_hint(h) if h.key else SessionId(f"anon:{next(self._anon_ids)}")
        return self._add(sid, h.request_class, now_s)

    def _add(self, sid: SessionId, request_class: RequestClass, now_s: float) -> Session:
        assert sid not in self._sessions, sid
        gaps = GapModel(self.fleet_gaps.tool_gap_s, self.fleet_gaps.human_gap_s)
        family = _family_id(sid) if sid.startswith(_HINT_PREFIX) else None
        if request_class is RequestClass.COMPACTION:
            request_class = RequestClass.MAIN
        if family is not None and family != sid and request_class is RequestClass.MAIN:
            request_class = RequestClass.SUBAGENT  # a branch (named by its agent id or detected)
        session = Session(session_id=sid, last_seen_s=now_s, gaps=gaps, family=family,
                          request_class=request_class)
        self._sessions[sid] = session
        if family is not None and family != sid:
            self._families.setdefault(family, []).append(session)
        return session

    def resolve(
        self, hint: SessionHint | str | None, prompt_hashes: list[BlockHash], now_s: float,
        continues: Callable[[Session], bool] = lambda _s: False, detect: bool = True,
    ) -> Session:
        """The session (routing unit) of a turn, created when new.

        With a key and no agent id, the turn belongs to the family member whose tail it extends
        deepest (the main thread or a detected branch). One that extends none of them is a new
        *branch* when the family has a turn in flight or its main thread is waiting on a tool
        (subagents under one header, told apart by their prompts); otherwise the main session
        (its first turn, or a new prefix after a compaction or ``/clear``). ``continues(s)``:
        the prompt holds all of ``s``'s first prompt where ``s`` lives, so it is the main thread
        whose client re-rendered later history, not a fresh branch (which shares the system
        prompt and tools at most)."""
        h = SessionHint.of(hint)
        if not h.key or h.agent_id or h.is_auxiliary or not detect:
            return self.find(h, prompt_hashes) or self.create(h, now_s)
        main = self._sessions.get(session_id_for_hint(h))
        if main is None:
            return self.create(h, now_s)
        members: list[Session] = [main, *self._families.get(main.session_id, ())]
        detected = [m for m in members if m is main or m.session_id.startswith(f"{main.session_id}/branch:")]
        positions = {bh: i for i, bh in enumerate(prompt_hashes)}
        best: tuple[int, Session] | None = None
        for member in detected:
            for tail in member.tail_hashes:
                at = positions.get(tail)
                if at is not None and (best is None or at > best[0]):
                    best = (at, member)
        if best is not None:
            return best[1]
        if h.request_class is RequestClass.COMPACTION or h.context_compacted:
            return main
        if continues(main):
            return main
        busy = any(m.num_in_flight for m in members)
        if busy or (main.last_stop is StopKind.TOOL_USE and main.tail_hashes):
            idle: list[Session] = [m for m in detected[1:] if m.num_in_flight == 0 and not m.tail_hashes]
            if idle:
                return idle[0]
            return self._add(SessionId(f"{main.session_id}/branch:{next(self._branch_ids)}"),
                             RequestClass.MAIN, now_s)
        return main

    def take_retired(self, session: Session, hint: SessionHint, broke: bool = False) -> list[BlockHash]:
        """Compaction: the request that summarises a session marks it; the session's next main
        turn (its compacted context) retires the old prefix. ``broke``: the turn is such a turn
        by its prompt (``Branches.prefix_broken``: Claude Code labels neither request). Returns
        the tails whose chains are dead (the caller lets their blocks go first, except those the
        new prompt shares) and forgets them as tails."""
        if hint.request_class is RequestClass.COMPACTION:
            session.compacting = True
            return []
        compacted = session.compacting or hint.context_compacted or broke
        if not compacted or session.request_class is RequestClass.AUXILIARY:
            return []
        session.compacting = False
        retired = list(session.tail_hashes)
        for tail in retired:
            if self._by_tail.get(tail) is session:
                del self._by_tail[tail]
        session.tail_hashes.clear()
        return retired

    def family_of(self, session: Session) -> list[Session]:
        """The session's family: its main session first (when known), then the branches."""
        if session.family is None:
            return [session]
        main = self._sessions.get(session.family)
        return [*([main] if main is not None else []), *self._families.get(session.family, ())]

    def record_arrival(self, session: Session, now_s: float, num_prompt_tokens: int = 0) -> None:
        """A new turn of ``session`` arrived: learn the gap since its last turn ended."""
        if not session.first_prompt_tokens:
            session.first_prompt_tokens = num_prompt_tokens
        if session.last_finish_s is not None and session.num_in_flight == 0:
            gap_s = now_s - session.last_finish_s
            session.gaps.observe(session.last_stop, gap_s)
            self.fleet_gaps.observe(session.last_stop, gap_s)
        session.last_seen_s = now_s
        self.idle.update(session, now_s)

    def set_home(self, session: Session, rank: Rank, now_s: float) -> None:
        """``session``'s turns go to ``rank`` from now on."""
        session.home_rank = rank
        self.idle.update(session, now_s)

    def moved(self, session: Session, rank: Rank, now_s: float) -> None:
        """``session`` was handed to ``rank`` through L1 (the router's move cooldown starts)."""
        session.moved_at_s = now_s
        self.set_home(session, rank, now_s)

    def turn_started(self, session: Session, now_s: float, home: Rank | None = None) -> None:
        """A turn of ``session`` is being admitted (it is busy, not idle, until ``turn_ended``),
        on ``home`` from now on when given (one recount for both changes)."""
        if home is not None:
            session.home_rank = home
        session.num_in_flight += 1
        self.idle.update(session, now_s)

    def turn_ended(self, session: Session, now_s: float) -> None:
        """A turn of ``session`` was closed (finished, aborted, or never admitted)."""
        session.num_in_flight = max(0, session.num_in_flight - 1)
        self.idle.update(session, now_s)

    def record_finish(
        self, session: Session, stop: StopKind, tail: BlockHash | None, context_tokens: int, now_s: float
    ) -> None:
        session.last_stop = stop
        session.last_finish_s = now_s
        session.last_seen_s = now_s
        session.context_tokens = context_tokens
        self.idle.update(session, now_s)
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
            if session.family is not None and session.family != sid:
                branches = self._families.get(session.family, [])
                if session in branches:
                    branches.remove(session)
                if not branches:
                    self._families.pop(session.family, None)
            self.idle.remove(sid)
        return dropped

    def clear_placement(self) -> None:
        """After a rank restart: every session keeps its gap model but loses its rank and tails."""
        self._by_tail.clear()
        for s in self._sessions.values():
            s.home_rank = None
            s.tail_hashes.clear()
        self.idle.clear()
