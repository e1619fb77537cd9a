"""The admission planner: ask what a turn takes on a rank, then commit it.

``ask`` reads the indexes as they are *now* (blocks may have gone while the turn queued) and
returns a frozen ``AdmitPlan``: how much of the prompt's prefix is resident (L0), how much more
L1 can restore, how many blocks the turn must reserve, and how many of them are not free. It
changes nothing. ``commit`` carries the plan out in the same synchronous step: pin the resident
prefix (before evicting, so the turn never evicts its own prefix), evict what the admission
level allows (``cache/admission.py``), reserve. It returns a frozen ``Reservation`` naming the
evicted blocks (in eviction order) and the chains that go to L1 before they are released, or
None when the level does not allow the eviction or it fell short (the turn waits).

Nothing is pinned while a turn queues, so a waiting turn never blocks the eviction the head of
the queue needs (that would deadlock).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache.admission import AdmitLevel
from cache.hashing import BlockHash
from cache.l0_index import Node
from cache.retire import ChainExport, Retirer
from cache.sessions import RequestClass, SessionId
from cache.state import CacheState
from rank.engine import usable_prefix_blocks
from rank.ids import Rank


@dataclass(frozen=True, slots=True)
class AdmitPlan:
    """What admitting one turn on ``rank`` takes, read from the indexes at one instant."""

    rank: Rank
    num_l0: int  # prefix blocks resident on the rank (pinned at commit)
    num_restore: int  # further prefix blocks to import from L1 (filled from L2 first if need be)
    need: int  # blocks to reserve: the sequence's own blocks + the restored ones
    num_free: int  # blocks the planner may take on the rank now (negative when overcommitted)

    @property
    def num_evict(self) -> int:
        """Blocks to evict before the reservation fits."""
        return max(0, self.need - self.num_free)


@dataclass(frozen=True, slots=True)
class Reservation:
    """A committed plan: the prefix is pinned and ``plan.need`` blocks are reserved. ``victims``
    left the index (releasing until ``Retirer.retire`` sends their release); ``exports`` are
    their sessions' chains to write to L1 first."""

    plan: AdmitPlan
    victims: tuple[Node, ...] = ()
    exports: tuple[ChainExport, ...] = ()


class AdmitPlanner:
    """``ask`` then ``commit`` (see the module docstring). One event loop."""

    def __init__(self, state: CacheState, retirer: Retirer) -> None:
        self._s = state
        self._retirer = retirer

    def ask(self, rank: Rank, hashes: Sequence[BlockHash], num_prompt_tokens: int,
            total_blocks: int) -> AdmitPlan:
        """The plan for a prompt named ``hashes`` whose sequence holds ``total_blocks`` on ``rank``."""
        s = self._s
        m0 = s.l0[rank].match(hashes)
        m1 = s.l1.match(hashes)[1] if s.l1_enabled else 0
        m2 = s.l2.match(hashes) if s.l2 is not None and s.l1_enabled else 0  # restored through L1
        usable = 0
        if s.config.prefix_cache:
            usable = usable_prefix_blocks(max(m0, m1, m2), num_prompt_tokens, s.block_size)
        num_l0 = min(m0, usable)
        return AdmitPlan(rank=rank, num_l0=num_l0, num_restore=usable - num_l0, need=total_blocks - num_l0,
                         num_free=s.ledgers[rank].plannable_free_blocks())

    def commit(
        self, plan: AdmitPlan, hashes: Sequence[BlockHash], sid: SessionId, level: AdmitLevel
    ) -> Reservation | None:
        """Pin, evict as ``level`` allows, reserve; None (and nothing held) when it does not fit.
        Blocks evicted by an attempt that still fell short go to L1 and are released at once:
        held, they would block the turn's next try."""
        s = self._s
        rank = plan.rank
        idx = s.l0[rank]
        now = s.clock()
        prefix = hashes[: plan.num_l0]
        idx.acquire(prefix, sid, now)  # before evicting: never evict our own prefix
        victims: list[Node] = []
        exports: tuple[ChainExport, ...] = ()
        if plan.num_evict:
            if level is AdmitLevel.FREE_ONLY:
                idx.release_uses(prefix)
                return None
            force = level is AdmitLevel.FORCE
            owner = s.sessions.get(sid)
            spare = owner is not None and owner.request_class is RequestClass.AUXILIARY
            victims = idx.evict(plan.num_evict, s.policy.scorer(rank, now),
                                s.policy.chooser(rank, now, force, spare_sessions=spare))
            # Releasing (not free) for every other planner until the release lands; this turn may
            # count them because it awaits their release (retire) before it allocates.
            exports = self._retirer.evicted(rank, victims)
            if len(victims) < plan.num_evict:
                idx.release_uses(prefix)
                if victims:
                    self._retirer.retire_later(rank, victims, exports)
                return None
        s.ledgers[rank].reserve(plan.need)
        return Reservation(plan, tuple(victims), exports)

    def undo(self, res: Reservation, hashes: Sequence[BlockHash]) -> None:
        """Give back a committed reservation that never became an admission (cancelled)."""
        s = self._s
        s.ledgers[res.plan.rank].unreserve(res.plan.need)
        s.l0[res.plan.rank].release_uses(hashes[: res.plan.num_l0])


def known_prefix_blocks(tail_hashes: Sequence[BlockHash], hashes: list[BlockHash]) -> int:
    """How many leading blocks of a prompt named ``hashes`` its session computed before: the
    deepest of the session's finished chains (``tail_hashes``) that the prompt extends."""
    positions = {h: i for i, h in enumerate(hashes)} if len(tail_hashes) > 1 else None
    known = 0
    for tail in tail_hashes:
        if positions is not None:
            at = positions.get(tail)
        else:
            try:  # one tail (the common case): a scan, no dict of the whole prompt
                at = hashes.index(tail)
            except ValueError:
                at = None
        if at is not None:
            known = max(known, at + 1)
    return known
