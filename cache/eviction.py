"""What a cached block is worth: the eviction value of its owner session, per rank.

Blocks are weighed by their owner session (``l0_index`` evicts by owner score, then recency,
then depth). The score is the session's expected wait until its next turn (``Session.
expected_wait_s``: seconds for a session waiting on a tool, minutes on a person, growing once a
session is overdue), so the session least likely to be back soon loses its tail first. It is
multiplied by ``l1_backed_factor`` when the session's blocks are also in L1, because dropping
those is free and getting them back costs one host-to-GPU copy instead of a prefill.

Blocks with no owner session (a compacted session's old prefix: ``cache/branches.py``), those
of a session whose home moved to another rank, and those of auxiliary requests (one-off titles,
memory passes) go first (score infinity). An auxiliary turn's admission evicts only such blocks,
never a main session's or a branch's (``spare_sessions``). A session whose expected wait is
under ``protect_s`` is *about to return*: admission may not evict it (``may_evict(owner,
force=False)`` is false) except after a bounded queue wait (``force=True``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from cache.sessions import RequestClass, SessionId, SessionTable


class EvictionPolicy:
    def __init__(
        self,
        sessions: SessionTable,
        is_l1_backed: Callable[[SessionId], bool],
        protect_s: float,
        l1_backed_factor: float = 4.0,
    ) -> None:
        self._sessions = sessions
        self._is_l1_backed = is_l1_backed
        self.protect_s = protect_s
        self.l1_backed_factor = l1_backed_factor

    def score(self, rank: int, owner: SessionId | None, now_s: float) -> float:
        """Higher means evict sooner."""
        session = self._sessions.get(owner) if owner is not None else None
        if session is None or (session.home_rank is not None and session.home_rank != rank) or (
            session.request_class is RequestClass.AUXILIARY
        ):
            return math.inf
        wait_s = session.expected_wait_s(now_s)
        if self._is_l1_backed(session.session_id):
            wait_s *= self.l1_backed_factor
        return wait_s

    def is_protected(self, rank: int, owner: SessionId | None, now_s: float) -> bool:
        session = self._sessions.get(owner) if owner is not None else None
        if session is None or (session.home_rank is not None and session.home_rank != rank) or (
            session.request_class is RequestClass.AUXILIARY
        ):
            return False
        return session.expected_wait_s(now_s) < self.protect_s

    def scorer(self, rank: int, now_s: float) -> Callable[[SessionId | None], float]:
        return lambda owner: self.score(rank, owner, now_s)

    def chooser(
        self, rank: int, now_s: float, force: bool, spare_sessions: bool = False
    ) -> Callable[[SessionId | None], bool]:
        """Which owners' blocks an admission may evict. ``spare_sessions`` (an auxiliary turn):
        only blocks that go first anyway (score infinity), whatever the level."""
        if spare_sessions:
            return lambda owner: self.score(rank, owner, now_s) == math.inf
        if force:
            return lambda owner: True
        return lambda owner: not self.is_protected(rank, owner, now_s)
