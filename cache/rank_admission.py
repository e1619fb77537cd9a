"""A turn's admission on its rank, and its close: what one ``Admission`` holds, from taking to
giving back.

``admit_on`` waits in the rank's queue (``cache/admission.py``), asking the planner at every try
(``cache/planner.py``: ask, then commit), retires the blocks the commit evicted (their L1 copy,
then the release, which rides with the turn's next command), restores the planned prefix blocks
from L1 (``cache/l1_restores.py``) and returns the ``Admission``: use refs on its prefix, its
blocks reserved. A small restore is folded into the turn's add instead of awaited
(``L1Restores.fold``): the admission returns at once with the L0 part pinned and the restored
blocks reserved, and the fold's reply (before any output of the turn) moves the pin onto them,
or, if the import failed, trims the prefix as a failed restore does. ``close`` gives both back
exactly once. A turn cancelled anywhere in between (the client went away) gives back what it
took before the cancellation propagates. A turn whose epoch ended while it waited (the rank group
restarted) is refused with a retry and touches nothing of the new epoch: its holds went with the
old one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from cache.admission import AdmitLevel
from cache.hashing import BlockHash
from cache.l1_restores import FoldedRestore, L1Restores
from cache.planner import AdmitPlanner, Reservation
from cache.retire import Retirer
from cache.sessions import RequestClass, Session
from cache.state import CacheState
from cache.turns import Admission, Tier, TierTokens
from protocol.errors import Overloaded
from rank.engine import usable_prefix_blocks
from rank.ids import Rank


class RankAdmitter:
    """Takes and gives back what admissions hold (see the module docstring). One event loop."""

    def __init__(self, state: CacheState, planner: AdmitPlanner, retirer: Retirer,
                 restores: L1Restores) -> None:
        self._s = state
        self._planner = planner
        self._retirer = retirer
        self._restores = restores
        self.open: set[Admission] = set()
        self._folds: dict[Admission, FoldedRestore] = {}  # open admissions whose fold has no reply yet

    async def admit_on(
        self, ranks: Sequence[Rank], session: Session, tokens: np.ndarray, hashes: list[BlockHash],
        num_output: int, order: Callable[[], Sequence[int]] | None = None, worst_output: int = 0,
    ) -> Admission:
        """Wait for room on one of ``ranks`` (ask + commit at each try; the first rank that can
        take the turn gets it, in ``order()`` when several could), retire the victims, restore."""
        s = self._s
        bs = s.block_size
        epoch = s.epoch
        num_prompt = len(tokens)
        sid = session.session_id
        # admit() checked the fit; every rank has the same pool
        total_blocks = min(-(-(num_prompt + num_output) // bs), s.ledgers[ranks[0]].usable_blocks())
        # Every admitted reply can reach its max_tokens: the running turns' worst cases fit the pool
        # together (cache/output_room.py), else the turn waits for one to end.
        worst_blocks = -(-(num_prompt + max(num_output, worst_output)) // bs)
        taken: list[Reservation] = []

        def try_admit(rank: int, level: AdmitLevel) -> bool:
            if s.epoch != epoch:
                return True  # the group restarted: admit and fail below
            plan = self._planner.ask(Rank(rank), hashes, num_prompt, total_blocks)
            if not s.ledgers[rank].worst_fits(worst_blocks, hashes, plan.num_l0):
                return False
            res = self._planner.commit(plan, hashes, sid, level)
            if res is not None:
                taken.append(res)
            return res is not None

        first_l0 = min(s.l0[ranks[0]].match(hashes), len(hashes))
        try:
            got, queue_s = await s.queue.enter_any(
                ranks, num_prompt - first_l0 * bs, try_admit, order, family=session.family,
                main=session.family is not None and session.session_id == session.family,
                yields=session.request_class is RequestClass.AUXILIARY,
            )
        except BaseException:
            if taken and taken[0].victims:
                self._retirer.retire_later(taken[0].plan.rank, list(taken[0].victims), taken[0].exports)
            raise
        rank = Rank(got)
        res = taken[0] if taken else None
        context_tokens = num_prompt + num_output
        # Counted in the router's load and the output room from the commit on, not only once the
        # victims' release was sent: a turn routed or admitted meanwhile must see this rank busy
        # and this turn's worst case promised.
        s.ledgers[rank].count_running(context_tokens, worst_blocks if res is not None else 0)
        if res is not None and res.victims:  # the release rides with the next command: one boundary
            try:
                await self._retirer.retire(rank, list(res.victims), epoch, wait_release=False,
                                           exports=res.exports)
            except BaseException:  # cancelled (client gone): give back what the commit took
                if s.epoch == epoch:
                    self._planner.undo(res, hashes)
                    s.ledgers[rank].uncount_running(context_tokens, worst_blocks)
                raise
        if s.epoch != epoch or res is None:
            if s.epoch == epoch:
                s.ledgers[rank].uncount_running(context_tokens)  # res is None: nothing was committed
            raise _restarted()
        plan = res.plan
        adm = Admission(
            rank=rank, prefix_blocks=[], num_cached_tokens=0, cached_tokens_by_tier=TierTokens(),
            queue_time_s=queue_s, restore_s=0.0, session_id=sid, epoch=epoch,
            keep_blocks=s.config.prefix_cache, num_prompt_tokens=num_prompt, hashes=hashes,
            num_used_blocks=plan.num_l0, room_blocks=total_blocks,
        )
        s.ledgers[rank].open(adm, plan.need, context_tokens, worst_blocks)
        if plan.num_restore:
            await self._restore(adm, hashes, plan.num_l0, plan.num_restore)
        adm.prefix_blocks = s.l0[rank].block_ids(hashes[: adm.num_used_blocks])
        adm.num_cached_tokens = (adm.num_used_blocks + (adm.fold.num_blocks if adm.fold else 0)) * bs
        by_tier = adm.cached_tokens_by_tier
        by_tier[Tier.L0] = adm.num_cached_tokens - by_tier[Tier.L1] - by_tier[Tier.L2]
        return adm

    def close(self, adm: Admission) -> bool:
        """Give back an admission's holds once. False if it was already closed, or its epoch is
        gone (the ledgers and index of that epoch went with it)."""
        if adm.is_closed:
            return False
        adm.is_closed = True
        self.open.discard(adm)
        s = self._s
        folded = self._folds.pop(adm, None)
        if folded is not None:
            self._restores.drop_fold(folded)
        session = s.sessions.get(adm.session_id)
        if session is not None:
            s.sessions.turn_ended(session, s.clock())
        if adm.epoch != s.epoch:
            return False
        self._release_holds(adm)
        return True

    async def _restore(self, adm: Admission, hashes: list[BlockHash], num_l0: int, num_restore: int) -> None:
        """Restore the planned blocks from L1; without them, the last L0 block is replayed."""
        s = self._s
        keep = usable_prefix_blocks(num_l0, adm.num_prompt_tokens, s.block_size)
        folded = self._restores.fold(adm.rank, adm.epoch, adm.session_id, hashes, num_l0, num_restore, keep,
                                     lambda filed, seconds: self._fold_settled(adm, filed, seconds))
        if folded is not None:
            self._folds[adm] = folded
            adm.fold = folded.request
            adm.cached_tokens_by_tier[Tier.L1] = num_restore * s.block_size  # unless it fails
            return
        try:
            got = await self._restores.restore(adm.rank, adm.epoch, adm.session_id, hashes, num_l0,
                                               num_restore)
        except BaseException:
            # Cancelled mid-restore (the client went away) or failed: this admission never
            # reaches the caller, so undo its holds here (admit() undoes the session's count).
            if s.epoch == adm.epoch and not adm.is_closed:
                adm.is_closed = True
                self._release_holds(adm)
            raise
        if s.epoch != adm.epoch:
            # The group restarted while the import ran: the index and ledger this admission
            # holds on went with the old epoch (nothing to give back), and those of the new one
            # are not its to touch; its close would skip them. Refused like a turn that waited.
            adm.is_closed = True
            raise _restarted()
        adm.restore_s = got.seconds
        if got.num_blocks:  # filed (same epoch, nothing awaited since): move the pin onto them
            count, bs = got.num_blocks, s.block_size
            idx = s.l0[adm.rank]
            idx.acquire(hashes[: num_l0 + count], adm.session_id, s.clock())
            idx.release_uses(hashes[:num_l0])
            adm.num_used_blocks = num_l0 + count
            adm.cached_tokens_by_tier[Tier.L1] = (count - got.num_l2) * bs
            adm.cached_tokens_by_tier[Tier.L2] = got.num_l2 * bs
            s.ledgers[adm.rank].restored(adm, count)  # reserved -> indexed (a short fill's rest stays)
        elif num_l0:
            # Without the L1 part the last L0 block is the replayed one (not a prefix block).
            idx = s.l0[adm.rank]
            keep = usable_prefix_blocks(num_l0, adm.num_prompt_tokens, s.block_size)
            idx.acquire(hashes[:keep], adm.session_id, s.clock())
            idx.release_uses(hashes[:num_l0])
            s.ledgers[adm.rank].grow(adm, num_l0 - keep)
            adm.num_used_blocks = keep

    def _fold_settled(self, adm: Admission, filed: bool, seconds: float) -> None:
        """The reply of the admission's fold (open, same epoch): pin the filed blocks, or keep the
        prefix the rank kept (``usable_prefix_blocks`` of the L0 part) and give the rest of the
        L0 pin back, as ``_restore`` does after a failed restore."""
        s = self._s
        folded = self._folds.pop(adm)
        adm.fold = None
        adm.restore_s = seconds
        num_l0, count, bs = adm.num_used_blocks, folded.count, s.block_size
        idx = s.l0[adm.rank]
        hashes = adm.hashes
        if filed:
            idx.acquire(hashes[: num_l0 + count], adm.session_id, s.clock())
            idx.release_uses(hashes[:num_l0])
            adm.num_used_blocks = num_l0 + count
            s.ledgers[adm.rank].restored(adm, count)
            return
        keep = folded.request.fallback_blocks
        idx.acquire(hashes[:keep], adm.session_id, s.clock())
        idx.release_uses(hashes[:num_l0])
        s.ledgers[adm.rank].grow(adm, num_l0 - keep)
        adm.num_used_blocks = keep
        adm.num_cached_tokens = keep * bs
        adm.cached_tokens_by_tier[Tier.L1] = 0
        adm.cached_tokens_by_tier[Tier.L0] = keep * bs

    def _release_holds(self, adm: Admission) -> None:
        self._s.ledgers[adm.rank].close(adm)
        self._s.l0[adm.rank].release_uses(adm.hashes[: adm.num_used_blocks])
        adm.num_used_blocks = 0


def _restarted() -> Overloaded:
    return Overloaded("the rank group restarted while the turn waited; retry", retry_after_s=1.0)
