"""``IdleLoad``: the router's idle-token term per rank, kept up to date as sessions change.

The load measure (``router.py``) counts, per rank, the last context of every *idle* session homed
there that is expected back within ``horizon_s``::

    counted(s, now) = s.home_rank is not None and s.num_in_flight == 0
                      and s.expected_wait_s(now) < horizon_s

Walking every session on each admission made the cache's per-turn cost O(sessions) (about 80 %
of a turn's CPU at 512-1,024 sessions). Here the sums are maintained incrementally and the result
is *exactly* the walk's, not an approximation:

* between two changes of a session (its owner, ``SessionTable``, calls ``update`` after every
  change of its home rank, turns in flight, last finish, stop kind, gap model or context: no other
  module writes those fields), ``counted`` depends
  on the time only, and it is true on one interval of time: with ``idle = now - last_finish``,
  ``expected_wait = max(gap - idle, idle)`` is below the horizon iff ``gap - idle < horizon``
  (turns true once, at ``last_finish + gap - horizon``) and ``idle < horizon`` (turns false
  once, at ``last_finish + horizon``); both are monotone in ``now`` in floating point too;
* so each session needs a re-check only at the next of those two instants. Re-checks sit in a
  heap and are scheduled a little *early* (``_EARLY_S``): at a re-check the predicate itself
  (``Session.expected_wait_s``) is evaluated, so rounding in the computed instant can only cause
  an extra re-check, never a stale sum. A re-check that finds the flip not yet reached is
  retried at the next query with a later time.

Per query: O(ranks) plus O(log n) per re-check that has come due (each session has at most two
per change). A clock that goes backwards (a test's fake clock) triggers a full rebuild, so any
clock gives the walk's result. ``check`` compares the sums with the walk (tests).
Superseded re-checks stay in the heap until popped or compacted (``_compact`` once they
outnumber the live ones 4:1), so the heap stays O(sessions).

Invariant: ``_tokens[r] == sum(tokens for (session, rank, tokens) in _counted.values() if rank
== r)``, and every session in ``_counted`` or with a pending re-check is the table's current
object for its id.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from cache.sessions import Session, SessionId

_EARLY_S = 1e-6  # re-checks run this much (plus 1e-9 relative) before the computed flip


class IdleLoad:
    """Per-rank sum of idle homed sessions' context tokens (module docstring)."""

    def __init__(self, num_ranks: int, horizon_s: float, sessions: Iterable[Session]) -> None:
        self.num_ranks = num_ranks
        self.horizon_s = horizon_s
        self._sessions = sessions  # the table (iterable); walked only when the clock goes back
        self._tokens = [0] * num_ranks
        self._counted: dict[SessionId, tuple[Session, int, int]] = {}  # sid -> (session, rank, tokens)
        self._due: dict[SessionId, int] = {}  # sid -> sequence number of its one valid re-check
        self._heap: list[tuple[float, int, Session]] = []
        self._seq = 0  # heap tie-break (sessions do not compare)
        self._last_now_s = -math.inf
        self.num_rechecks = 0

    def tokens(self, now_s: float) -> list[int]:
        """Idle tokens per rank at ``now_s`` (runs the re-checks that have come due)."""
        if now_s < self._last_now_s:
            self._rebuild(now_s)
        self._last_now_s = now_s
        heap = self._heap
        while heap and heap[0][0] <= now_s:
            _, seq, session = heapq.heappop(heap)
            if self._due.get(session.session_id) == seq:
                del self._due[session.session_id]
                self.num_rechecks += 1
                self._evaluate(session, now_s)
        return list(self._tokens)

    def update(self, session: Session, now_s: float) -> None:
        """``session`` changed (or is new): recount it now."""
        self._evaluate(session, now_s)

    def remove(self, session_id: SessionId) -> None:
        """The session is gone from the table."""
        self._uncount(session_id)
        self._due.pop(session_id, None)

    def clear(self) -> None:
        """Every session lost its rank (a group restart): nothing counts."""
        self._tokens = [0] * self.num_ranks
        self._counted.clear()
        self._due.clear()
        self._heap.clear()

    def check(self, now_s: float) -> None:
        """Assert the sums equal the walk over every session (tests; O(sessions))."""
        walked = [0] * self.num_ranks
        for s in self._sessions:
            if s.home_rank is not None and s.num_in_flight == 0 and s.expected_wait_s(now_s) < self.horizon_s:
                walked[s.home_rank] += s.context_tokens
        got = self.tokens(now_s)
        assert got == walked, f"idle tokens per rank {got} != walk over the sessions {walked}"

    # ------------------------------------------------------------------ internals

    def _uncount(self, sid: SessionId) -> None:
        entry = self._counted.pop(sid, None)
        if entry is not None:
            self._tokens[entry[1]] -= entry[2]

    def _evaluate(self, session: Session, now_s: float) -> None:
        sid = session.session_id
        self._uncount(sid)
        self._due.pop(sid, None)
        rank = session.home_rank
        if rank is None or session.num_in_flight > 0:
            return  # changes only through a call to update
        horizon = self.horizon_s
        if session.expected_wait_s(now_s) < horizon:
            tokens = session.context_tokens
            self._counted[sid] = (session, rank, tokens)
            self._tokens[rank] += tokens
            counted = True
        else:
            counted = False
        last_finish = session.last_finish_s
        if last_finish is None:
            return  # expected wait 0 until the session changes
        idle_s = max(0.0, now_s - last_finish)
        if counted:
            flip_s = last_finish + horizon  # idle reaches the horizon
        elif idle_s < horizon:
            gap_s = session.expected_gap_s()
            if gap_s - horizon >= horizon:
                return  # by the time it is expected within the horizon, it is idle too long
            flip_s = last_finish + (gap_s - horizon)  # expected within the horizon from here on
        else:
            return  # idle past the horizon: stays out until it changes
        due_s = max(flip_s - _EARLY_S - 1e-9 * abs(flip_s), math.nextafter(now_s, math.inf))
        self._seq += 1
        self._due[sid] = self._seq
        heapq.heappush(self._heap, (due_s, self._seq, session))
        if len(self._heap) > 64 and len(self._heap) > 4 * len(self._due):
            self._compact()

    def _compact(self) -> None:
        """Drop superseded re-checks (each update leaves its old one behind)."""
        self._heap = [e for e in self._heap if self._due.get(e[2].session_id) == e[1]]
        heapq.heapify(self._heap)

    def _rebuild(self, now_s: float) -> None:
        """The clock went back: a session past its window may be inside it again. Recount all."""
        self.clear()
        for s in self._sessions:
            self._evaluate(s, now_s)
