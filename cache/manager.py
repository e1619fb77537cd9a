"""``CacheManager``: the facade the server's service uses for every turn.

One turn::

    cache.prefetch(session_hint)                 # optional, as soon as the headers are read
    adm = await cache.admit(prompt_ids, session_hint, max_tokens)   # sampling.max_tokens = adm.max_output_tokens
    try:
        stream = client.submit(adm.rank, adm.engine_request(request_id, prompt_ids, sampling))
        async for out in stream:                 # last output has finished=True
            cache.make_room(adm, num_output_tokens_so_far)
    except BaseException:
        cache.abort(adm)                         # no terminal output will come (or it was lost)
        raise
    cache.finish(adm, prompt_ids, output_ids, last_output, stop_kind)

``admit`` hashes the prompt, finds (or creates) the session, routes it (``router.py``), pins the
L0 prefix it will start from, waits for room (``admission.py``: evicting by value, never a
session about to return), restores blocks from L1 when the host pool holds more of the prefix
than the GPU, and returns an ``Admission`` holding use refs on the prefix. ``finish`` files the
finished turn's kept blocks (duplicates released to the rank), releases the use refs, learns the
session's stop kind and schedules a write-through to L1 when the rank's pool is past the
watermark. ``abort`` only releases. Exactly one of ``finish``/``abort`` per admission; a second
call is a no-op.

Accounting (``check_balance`` asserts it once quiescent): per rank, blocks filed in the L0 index
== blocks the engine holds a cache ref on; ``reserved_blocks`` == the sum over open admissions
of the blocks they may still allocate; no use refs without an open admission; L1 slots in use ==
the extents of its entries. A rank restart (new epoch) forgets every L0 and L1 entry, and
admissions of the old epoch are closed without touching the new engines.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cache.admission import AdmissionQueue, AdmitLevel
from cache.config import CacheConfig
from cache.eviction import EvictionPolicy
from cache.gauges import GaugeRefresher
from cache.hashing import BlockHash, ChainHasher, as_token_array
from cache.idle_load import IdleLoad
from cache.l0_index import L0Index, Node, RankIndex
from cache.l1_index import L1Index, WritePlan
from cache.metrics import CacheMetrics
from cache.output_room import OutputRoom, output_limit
from cache.router import RankLoad, Router
from cache.sessions import Session, SessionId, SessionTable, StopKind
from protocol.errors import InvalidRequest, Overloaded, PromptTooLong
from rank.client import RankClient
from rank.engine import (
    CapacityExhausted,
    EngineMisuse,
    EngineRequest,
    RequestOutput,
    SamplingParams,
    usable_prefix_blocks,
)
from rank.errors import RankFailed, RankUnavailable

log = logging.getLogger(__name__)

_RANK_ERRORS = (RankFailed, RankUnavailable, CapacityExhausted, EngineMisuse, NotImplementedError)
_IMPORT_ATTEMPTS = 3  # an import the engine is short for is retried (see _import)
_IMPORT_RETRY_S = 0.02  # x attempt number: about one engine step between tries


@dataclass(slots=True, eq=False)
class Admission:
    """One admitted turn. The public fields are what the service needs; the rest is the
    manager's receipt (use refs held, blocks reserved)."""

    rank: int
    prefix_blocks: list[int]
    num_cached_tokens: int
    cached_tokens_by_tier: dict[str, int]  # {"l0": GPU-resident, "l1": restored from host}
    queue_time_s: float
    restore_s: float
    session_id: SessionId
    epoch: int
    keep_blocks: bool
    num_prompt_tokens: int
    hashes: list[BlockHash] = field(repr=False)
    num_used_blocks: int = 0  # use refs held on hashes[:num_used_blocks] on ``rank``
    reserved_blocks: int = 0  # blocks the sequence may still allocate (released at close)
    context_tokens: int = 0
    max_output_tokens: int = 1  # the engine request's max_tokens (trimmed to the KV room if a default)
    room_blocks: int = 0  # blocks the turn may hold: prefix + reserved; grows while it decodes
    is_closed: bool = False

    def engine_request(
        self, request_id: str, prompt_ids: np.ndarray, sampling: SamplingParams
    ) -> EngineRequest:
        return EngineRequest(
            request_id=request_id,
            prompt_ids=as_token_array(prompt_ids),
            sampling=sampling,
            prefix_blocks=list(self.prefix_blocks),
            num_cached_tokens=self.num_cached_tokens,
            keep_blocks=self.keep_blocks,
        )


@dataclass(slots=True, eq=False)
class _ChainExport:
    """An evicted session's chain to write to L1 before its blocks are released: ``pinned`` is
    the filed prefix of it (one use held on its deepest node until the export is done)."""

    owner: SessionId
    chain_nodes: list[Node]
    pinned: list[BlockHash]


@dataclass(slots=True)
class _RankLedger:
    """What the manager may plan on per rank. Free = capacity - indexed - reserved - releasing:
    a block whose release is still in flight is held by the engine until the release lands, so
    it is not free yet (planning on it made imports fail with CapacityExhausted)."""

    capacity_blocks: int  # num_blocks - 1 (block 0 is scratch)
    reserved_blocks: int = 0
    running_tokens: int = 0
    num_in_flight: int = 0
    num_releasing: int = 0  # blocks out of the index whose release has not landed yet

    def free_blocks(self, num_indexed: int) -> int:
        return self.capacity_blocks - num_indexed - self.reserved_blocks - self.num_releasing


class CacheManager:
    """See the module docstring. One event loop; not thread-safe."""

    def __init__(
        self,
        client: RankClient,
        config: CacheConfig,
        metrics: CacheMetrics | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        if config.prefix_cache and getattr(client, "prefix_cache_supported", True) is False:
            # The engine cannot start from cached blocks (DeepInfer without the prefix-cache
            # patch): no L0, and hence no L1 (_sync_l1 keys it off prefix_cache).
            reason = getattr(client, "prefix_cache_reason", None) or "not supported by the engine"
            log.warning("prefix cache (L0) and L1 off: %s", reason)
            config = config.model_copy(update={"prefix_cache": False})
        self.config = config
        self.metrics = metrics
        self._clock = clock
        self.block_size = client.block_size
        self.num_ranks = client.num_ranks
        self.hasher = ChainHasher(client.block_size, config.hash_salt.encode())
        self.sessions = SessionTable()
        # The router's idle-token term, kept incrementally: call self._idle.update(session, now)
        # after every change of a session's home_rank, num_in_flight, last finish/stop, gaps or
        # context_tokens (check_balance asserts it equals the walk over all sessions).
        self._idle = IdleLoad(client.num_ranks, config.home_horizon_s, self.sessions)
        self.l0 = L0Index(client.num_ranks)
        self.l1 = L1Index(0, config.l1_headroom_fraction, config.l1_min_headroom_blocks)
        self.l1_off_reason: str | None = "not started"
        self.policy = EvictionPolicy(
            self.sessions, lambda sid: self.l1.backed_blocks(sid) > 0, config.protect_s
        )
        self.router = Router(config.router(), client.block_size)
        self.queue = AdmissionQueue(client.num_ranks, config.admission(), clock)
        self.epoch = client.epoch
        self._ledgers = [_RankLedger(max(0, client.num_blocks - 1)) for _ in range(client.num_ranks)]
        self._open: set[Admission] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._prefetches: dict[SessionId, asyncio.Task[None]] = {}
        self._l1_writes: dict[SessionId, asyncio.Event] = {}  # set when the session's write ends
        # Blocks a prefetch restored from L1 that no admission of the session has counted yet:
        # its next admission finds them resident but counts them as L1 (restored), not L0.
        self._prefetched: dict[SessionId, set[BlockHash]] = {}
        self._num_finished = 0
        # Diagnostics (also in metrics): blocks dropped from a GPU with no L1 copy, exports of
        # evicted sessions that could not be written, and admissions that got less of their
        # session's known prefix than it had computed (recomputed prefix tokens).
        self.num_evicted_unbacked_blocks = 0
        self.num_export_failures = 0
        self.num_partial_prefix_admissions = 0
        self.num_lost_prefix_tokens = 0
        self._gauges = GaugeRefresher(self._refresh_gauges)
        self.output_room = OutputRoom(self)
        self._rank_gauges = (
            [(metrics.rank_load_tokens.labels(str(r)), metrics.rank_free_blocks.labels(str(r)),
              metrics.rank_cached_blocks.labels(str(r)), metrics.queue_depth.labels(str(r)))
             for r in range(client.num_ranks)]
            if metrics is not None else []
        )
        client.add_restart_listener(self._on_restart)
        self._sync_l1()

    # ================================================================= public API

    @property
    def l1_enabled(self) -> bool:
        return self.l1_off_reason is None

    def prefetch(self, session_hint: str | None) -> None:
        """Start restoring a known session's blocks from L1 to its rank before its prompt is
        tokenized (the service calls this as soon as it has read the headers)."""
        if not session_hint or not self.config.prefix_cache or not self.l1_enabled:
            return
        session = self.sessions.get(SessionId("hint:" + session_hint))
        if session is None or session.home_rank is None or session.session_id in self._prefetches:
            return
        entry = self.l1.entries.get(session.session_id)
        if entry is None:
            return
        rank = session.home_rank
        idx = self.l0[rank]
        m0 = idx.match(entry.hashes)
        num_restore = len(entry.hashes) - 1 - m0  # the last block is replayed by the next turn
        if num_restore <= 0:
            return
        ledger = self._ledgers[rank]
        if ledger.free_blocks(len(idx)) - self._keep_out_blocks(ledger) < num_restore:
            return  # no room without evicting: the turn's own admission decides
        ledger.reserved_blocks += num_restore
        # Hold the entry now, not when the task starts: a write-through in between could cut it
        # back and overwrite the very slots this import reads.
        self.l1.begin_read(entry)
        chain = entry.hashes[: m0 + num_restore]
        anchor = chain[m0 - 1] if m0 else None
        task = self._spawn(self._prefetch(session, rank, entry, chain, m0, anchor, self.epoch))
        self._prefetches[session.session_id] = task

    async def admit(
        self, prompt_ids: np.ndarray | Sequence[int], session_hint: str | None, max_tokens: int,
        *, max_tokens_is_default: bool = False,
    ) -> Admission:
        """Route, pin, queue if needed, restore; see the module docstring. A turn whose prompt
        plus ``max_tokens`` cannot fit a rank's usable pool is refused before it queues
        (``cache/output_room.py``), unless ``max_tokens`` is a default: then it is trimmed."""
        tokens = as_token_array(prompt_ids)
        if tokens.size == 0:
            raise InvalidRequest("prompt is empty", param="messages")
        # A running sequence holds all its blocks (shared prefix ones too), so a turn must fit a
        # rank's usable pool whole (every rank has the same pool).
        limit = self._ledgers[0].capacity_blocks - self._keep_out_blocks(self._ledgers[0])
        if -(-(len(tokens) + 1) // self.block_size) > limit:
            raise PromptTooLong(len(tokens), max(0, limit * self.block_size - 1))
        max_output = output_limit(len(tokens), max(1, max_tokens), limit * self.block_size, max_tokens_is_default)
        now = self._clock()
        self._sync_l1()
        hashes = self.hasher.hashes(tokens) if self.config.prefix_cache else []
        session = self.sessions.find(session_hint, hashes) or self.sessions.create(session_hint, now)
        self.sessions.record_arrival(session, now)
        self._idle.update(session, now)
        pending = self._prefetches.pop(session.session_id, None)
        if pending is not None:
            try:
                await asyncio.shield(pending)
            except Exception:  # a failed prefetch only means the turn restores or recomputes
                log.debug("prefetch for %s failed", session.session_id, exc_info=True)
        matches = self.l0.match_all(hashes)
        decision = self.router.route(
            session, matches, len(tokens), self.loads(), self.l1_enabled and self.config.prefix_cache, now
        )
        rank = decision.rank
        if decision.move_from is not None:
            if not await self._move(session, decision.move_from, rank, hashes, matches[decision.move_from]):
                rank = decision.move_from
        session.home_rank = rank
        session.num_in_flight += 1
        self._idle.update(session, now)
        try:
            num_reserve = min(max_output, self.config.output_reserve_tokens)
            adm = await self._admit_on(rank, session, tokens, hashes, num_reserve)
            adm.max_output_tokens = max_output
        except BaseException:
            session.num_in_flight -= 1
            self._idle.update(session, self._clock())
            if self.metrics is not None:
                self.metrics.admissions.labels("rejected").inc()
            raise
        self._count_prefetched(adm, hashes)
        self._count_lost_prefix(session, adm, hashes)
        self._open.add(adm)
        self._observe_admission(adm)
        return adm

    def finish(
        self,
        admission: Admission,
        prompt_ids: np.ndarray | Sequence[int],
        output_ids: Sequence[int],
        output: RequestOutput,
        stop_kind: StopKind = StopKind.UNKNOWN,
    ) -> None:
        """The turn ended with ``output`` (its terminal RequestOutput): file its kept blocks."""
        num_known = admission.num_used_blocks  # filed and pinned until _close, no await between
        if not self._close(admission):
            return
        rank = admission.rank
        kept = list(output.kept_blocks)
        now = self._clock()
        full_hashes: list[BlockHash] = []
        num_tokens = len(prompt_ids) + len(output_ids)
        if kept:
            expected = (num_tokens - 1) // self.block_size
            if not self.config.prefix_cache or len(kept) != expected:
                if self.config.prefix_cache:
                    log.warning(
                        "request on rank %d kept %d blocks for %d tokens (expected %d); releasing them",
                        rank, len(kept), num_tokens, expected,
                    )
                self._release_later(rank, kept)
            else:
                full = np.concatenate([as_token_array(prompt_ids), as_token_array(output_ids)])
                full_hashes = self.hasher.extend(admission.hashes, full)[: len(kept)]
                duplicates = self.l0[rank].insert(
                    full_hashes, kept, admission.session_id, now, num_known=num_known
                )
                if self.metrics is not None and duplicates:
                    self.metrics.duplicate_blocks.inc(len(duplicates))
                self._release_later(rank, duplicates)
        session = self.sessions.get(admission.session_id)
        if session is not None:
            tail = full_hashes[-1] if full_hashes else None
            self.sessions.record_finish(session, stop_kind, tail, num_tokens, now)
            self._idle.update(session, now)
        if full_hashes and self.l1_enabled and self._pool_usage(rank) >= self.config.l1_write_watermark:
            self._spawn(self._write_through(rank, admission.session_id, full_hashes, self.epoch))
        self._num_finished += 1
        if self._num_finished % 64 == 0:
            self._forget_idle_sessions(now)
        self.queue.notify(rank)
        self._update_gauges()

    def make_room(self, admission: Admission, num_output_tokens: int) -> None:
        """A running turn has produced ``num_output_tokens``: grow its KV reservation ahead of
        its decode, evicting idle blocks if needed (``cache/output_room.py``). The service calls
        this as outputs arrive; it returns at once while the reservation has room to spare."""
        if self.output_room.needs_room(admission, num_output_tokens):
            self.output_room.grow(admission, num_output_tokens)

    def abort(self, admission: Admission) -> None:
        """The turn will not produce a terminal output to file (submit failed, the rank group
        failed, or the service gave up): release what the admission holds."""
        if self._close(admission):
            self.queue.notify(admission.rank)

    def loads(self) -> list[RankLoad]:
        """The router's load measure per rank (documented in ``router.py``). O(ranks): the idle
        term is kept incrementally (``cache/idle_load.py``, exact, no approximation)."""
        idle = self._idle.tokens(self._clock())
        out = []
        for rank, ledger in enumerate(self._ledgers):
            free = ledger.free_blocks(len(self.l0[rank]))
            out.append(
                RankLoad(rank, ledger.running_tokens, self.queue.waiting_tokens(rank), idle[rank], free)
            )
        return out

    async def rebalance(self) -> int:
        """Move idle sessions off overloaded ranks through L1. Returns how many moved."""
        if not (self.l1_enabled and self.config.prefix_cache):
            return 0
        moved = 0
        now = self._clock()
        for session in sorted(self.sessions, key=lambda s: (-s.context_tokens, s.session_id)):
            src = session.home_rank
            if src is None or session.num_in_flight:
                continue
            decision = self.router.route(session, [0] * self.num_ranks, 0, self.loads(), True, now)
            if decision.move_from is None:
                continue
            chain = self._session_chain(src, session)
            if await self._move(session, src, decision.rank, chain, len(chain)):
                session.home_rank = decision.rank
                self._idle.update(session, self._clock())
                moved += 1
        return moved

    async def move_session(self, session_hint: str, dst: int) -> bool:
        """Hand an idle session to rank ``dst`` through L1 (operators and tests; ``rebalance``
        does this by load). Its next turn restores its blocks on ``dst``."""
        session = self.sessions.get(SessionId("hint:" + session_hint))
        if session is None or session.home_rank is None or session.num_in_flight:
            return False
        if not 0 <= dst < self.num_ranks:
            raise ValueError(f"rank {dst} outside 0..{self.num_ranks - 1}")
        if dst == session.home_rank or not self.l1_enabled:
            return dst == session.home_rank
        chain = self._session_chain(session.home_rank, session)
        return await self._move(session, session.home_rank, dst, chain, len(chain))

    async def drain(self) -> None:
        """Wait for background work (releases, write-throughs, prefetches) to finish."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def check_balance(self) -> None:
        """Assert the accounting invariants (tests call it after ``drain`` with no turn open)."""
        self._idle.check(self._clock())
        for rank, idx in enumerate(self.l0.ranks):
            idx.check()
            ledger = self._ledgers[rank]
            open_here = [a for a in self._open if a.rank == rank and a.epoch == self.epoch]
            reserved = sum(a.reserved_blocks for a in open_here)
            assert ledger.reserved_blocks == reserved, f"rank {rank}: reserved {ledger.reserved_blocks} != {reserved}"
            assert ledger.num_in_flight == len(open_here)
            if not self._tasks:
                assert ledger.num_releasing == 0, f"rank {rank}: {ledger.num_releasing} releases pending"
                stats = self.client.stats(rank)
                assert stats.num_cached_blocks == len(idx), (
                    f"rank {rank}: engine holds {stats.num_cached_blocks} cached blocks, index {len(idx)}"
                )
            if not open_here and not self._tasks:
                in_use = [n.block_id for n in idx.nodes.values() if n.use_count]
                assert not in_use, f"rank {rank}: use refs leaked on blocks {in_use[:8]}"
        self.l1.check()
        if not self._tasks:
            assert not self.l1._pending, "L1 writes pending with no task"
            held = [e.session_id for e in self.l1.entries.values() if e.num_holds]
            assert not held, f"L1 entries still held: {held[:4]}"

    # ================================================================= admission

    async def _admit_on(
        self, rank: int, session: Session, tokens: np.ndarray, hashes: list[BlockHash], num_output: int
    ) -> Admission:
        bs = self.block_size
        idx = self.l0[rank]
        ledger = self._ledgers[rank]
        epoch = self.epoch
        num_prompt = len(tokens)
        sid = session.session_id
        limit = ledger.capacity_blocks - self._keep_out_blocks(ledger)
        total_blocks = min(-(-(num_prompt + num_output) // bs), limit)  # admit() checked the fit
        plan: dict[str, int] = {}
        victims: list[Node] = []
        exports: list[_ChainExport] = []

        def try_admit(level: AdmitLevel) -> bool:
            """Plan against the index as it is *now* (blocks may have gone while queued), pin the
            prefix, evict what ``level`` allows, reserve. Nothing is pinned while queued, so a
            waiting turn never blocks the eviction the head of the queue needs."""
            if self.epoch != epoch:
                return True  # the group restarted: admit and fail below
            now = self._clock()
            m0 = idx.match(hashes)
            m1 = self.l1.match(hashes)[1] if self.l1_enabled else 0
            usable = usable_prefix_blocks(max(m0, m1), num_prompt, bs) if self.config.prefix_cache else 0
            num_l0 = min(m0, usable)
            num_restore = usable - num_l0
            need = total_blocks - num_l0  # the sequence's own blocks + the restored ones
            free = ledger.free_blocks(len(idx)) - self._keep_out_blocks(ledger)
            idx.acquire(hashes[:num_l0], sid, now)  # before evicting: never evict our own prefix
            if need > free:
                if level is AdmitLevel.FREE_ONLY:
                    idx.release_uses(hashes[:num_l0])
                    return False
                force = level is AdmitLevel.FORCE
                got = idx.evict(need - free, self.policy.scorer(rank, now), self.policy.chooser(rank, now, force))
                # Releasing (not free) for every other planner until the release lands; this turn
                # may count them because it awaits their release (_retire) before it allocates.
                ledger.num_releasing += len(got)
                free += len(got)
                got_exports = self._hold_for_export(rank, got)
                if need > free:
                    idx.release_uses(hashes[:num_l0])
                    if got:  # export and release them now: held, they would block our next try
                        self._spawn(self._retire(rank, got, epoch, exports=got_exports))
                    return False
                victims.extend(got)
                exports.extend(got_exports)
            ledger.reserved_blocks += need
            plan.update(num_l0=num_l0, num_restore=num_restore, need=need)
            return True

        first_l0 = min(idx.match(hashes), len(hashes))
        try:
            queue_s = await self.queue.enter(rank, num_prompt - first_l0 * bs, try_admit)
        except BaseException:
            if victims:
                self._spawn(self._retire(rank, victims, epoch, exports=exports))
            raise
        if victims:  # the release rides with the next command (import or submit): one boundary
            try:
                await self._retire(rank, victims, epoch, wait_release=False, exports=exports)
            except BaseException:  # cancelled (client gone): give back what try_admit took
                if self.epoch == epoch:
                    ledger.reserved_blocks -= plan["need"]
                    idx.release_uses(hashes[: plan["num_l0"]])
                raise
        if self.epoch != epoch:
            raise Overloaded("the rank group restarted while the turn waited; retry", retry_after_s=1.0)
        num_l0, num_restore, need = plan["num_l0"], plan["num_restore"], plan["need"]
        adm = Admission(
            rank=rank, prefix_blocks=[], num_cached_tokens=0, cached_tokens_by_tier={"l0": 0, "l1": 0},
            queue_time_s=queue_s, restore_s=0.0, session_id=sid, epoch=epoch,
            keep_blocks=self.config.prefix_cache, num_prompt_tokens=num_prompt, hashes=hashes,
            num_used_blocks=num_l0, reserved_blocks=need, context_tokens=num_prompt + num_output,
            room_blocks=total_blocks,
        )
        ledger.num_in_flight += 1
        ledger.running_tokens += adm.context_tokens
        if num_restore:
            try:
                restored = await self._restore(adm, hashes, num_l0, num_restore)
            except BaseException:
                # Cancelled mid-restore (the client went away) or failed: this admission never
                # reaches the caller, so undo its holds here (admit() undoes the session's count).
                if self.epoch == epoch and not adm.is_closed:
                    adm.is_closed = True
                    ledger.reserved_blocks -= adm.reserved_blocks
                    ledger.running_tokens -= adm.context_tokens
                    ledger.num_in_flight -= 1
                    self.l0[rank].release_uses(hashes[: adm.num_used_blocks])
                    adm.num_used_blocks = 0
                raise
            if not restored and num_l0:
                # Without the L1 part the last L0 block is the replayed one (not a prefix block).
                keep = usable_prefix_blocks(num_l0, num_prompt, bs)
                idx.acquire(hashes[:keep], sid, self._clock())
                idx.release_uses(hashes[:num_l0])
                adm.reserved_blocks += num_l0 - keep
                ledger.reserved_blocks += num_l0 - keep
                adm.num_used_blocks = keep
        adm.prefix_blocks = idx.block_ids(hashes[: adm.num_used_blocks])
        adm.num_cached_tokens = adm.num_used_blocks * bs
        adm.cached_tokens_by_tier["l0"] = adm.num_cached_tokens - adm.cached_tokens_by_tier["l1"]
        return adm

    async def _restore(self, adm: Admission, hashes: list[BlockHash], first: int, count: int) -> bool:
        """Copy blocks ``first .. first+count`` of the prompt's chain from L1 into the rank."""
        rank, epoch = adm.rank, adm.epoch
        ledger = self._ledgers[rank]
        entry, m1 = self.l1.match(hashes)
        ok = False
        if entry is not None and m1 >= first + count:
            self.l1.begin_read(entry)
            started = self._clock()
            try:
                ids = await self._import(rank, entry.start_slot + first, count, epoch)
            except _RANK_ERRORS as exc:
                log.warning("L1 restore of %d blocks on rank %d failed: %s", count, rank, exc)
                ids = None
                self._maybe_disable_l1(exc)
            finally:
                self.l1.end_read(entry)
            adm.restore_s = self._clock() - started
            if ids is not None and self.epoch == epoch:
                idx = self.l0[rank]
                # File the restored blocks under their filed prefix (depth and parent links
                # intact); the prefix's own ids come back first among the duplicates: skip them.
                known = idx.block_ids(hashes[:first])
                duplicates = idx.insert(hashes[: first + count], known + list(ids), adm.session_id,
                                        self._clock())[first:]
                self._release_later(rank, duplicates)
                idx.acquire(hashes[: first + count], adm.session_id, self._clock())  # move the pin
                idx.release_uses(hashes[:first])
                adm.num_used_blocks = first + count
                adm.cached_tokens_by_tier["l1"] = count * self.block_size
                ok = True
                if self.metrics is not None:
                    self.metrics.restored_tokens.inc(count * self.block_size)
                    self.metrics.restore_seconds.observe(adm.restore_s)
        if ok:  # filed in the index now; on failure the turn computes them: they stay reserved
            if self.epoch == epoch:
                ledger.reserved_blocks -= count
            adm.reserved_blocks -= count
        return ok

    async def _import(self, rank: int, host_slot: int, count: int, epoch: int) -> list[int]:
        """``import_blocks`` that rides out blocks the engine still holds for a moment: releases
        in flight (waited for) and sequences aborted but not yet reaped (the engine frees them
        at its next step). Retried a bounded number of times; the last CapacityExhausted is raised."""
        for attempt in range(_IMPORT_ATTEMPTS):
            try:
                return await self.client.import_blocks(rank, host_slot, count)
            except CapacityExhausted:
                if attempt == _IMPORT_ATTEMPTS - 1 or self.epoch != epoch:
                    raise
                await self._await_releases(rank, epoch)
                await asyncio.sleep(_IMPORT_RETRY_S * (attempt + 1))
        raise AssertionError("unreachable")

    def _close(self, adm: Admission) -> bool:
        """Release an admission's holds once. Returns False if it was already closed."""
        if adm.is_closed:
            return False
        adm.is_closed = True
        self._open.discard(adm)
        session = self.sessions.get(adm.session_id)
        if session is not None:
            session.num_in_flight = max(0, session.num_in_flight - 1)
            self._idle.update(session, self._clock())
        if adm.epoch != self.epoch:
            return False  # the ledgers and index of that epoch are gone
        ledger = self._ledgers[adm.rank]
        ledger.reserved_blocks -= adm.reserved_blocks
        ledger.running_tokens -= adm.context_tokens
        ledger.num_in_flight -= 1
        self.l0[adm.rank].release_uses(adm.hashes[: adm.num_used_blocks])
        adm.num_used_blocks = 0
        return True

    # ================================================================= L1 transfers

    async def _write_through(
        self, rank: int, sid: SessionId, chain: list[BlockHash], epoch: int, nodes: list[Node] | None = None
    ) -> bool:
        """Copy a session's chain (blocks filed on ``rank``, or ``nodes`` being evicted) to L1.

        Chained after a write of the same session still in flight (one write per session at a
        time, and the later one copies only what the earlier did not). Returns True when L1
        holds the chain afterwards; False only when it cannot (not resident, no L1 room, the
        copy failed, or the group restarted)."""
        if not await self._wait_l1_write(sid, epoch):
            return False
        plan = self.l1.plan_write(sid, chain, self._clock(), self._l1_score)
        if plan is None:
            return self.l1.holds_chain(sid, chain)
        done = asyncio.Event()
        self._l1_writes[sid] = done
        try:
            return await self._export_plan(rank, plan, chain, epoch, nodes)
        finally:
            if self._l1_writes.get(sid) is done:
                del self._l1_writes[sid]
            done.set()

    async def _wait_l1_write(self, sid: SessionId, epoch: int) -> bool:
        """Wait until no L1 write of ``sid`` is in flight. False if the group restarted meanwhile.
        Returns without awaiting when none is (callers rely on that: see ``_retire``)."""
        while (pending := self._l1_writes.get(sid)) is not None:
            await pending.wait()
        return self.epoch == epoch

    async def _export_plan(
        self, rank: int, plan: WritePlan, chain: list[BlockHash], epoch: int, nodes: list[Node] | None
    ) -> bool:
        idx = self.l0[rank]
        part = chain[plan.first_block :]
        if nodes is None:
            if idx.match(chain) < len(chain):
                self.l1.abort(plan)
                return False
            pinned = chain
            ids = idx.block_ids(part)
        else:  # an evicted tail (held until released) under a still-filed prefix
            pinned = [n.block_hash for n in nodes if idx.nodes.get(n.block_hash) is n]
            ids = [n.block_id for n in nodes[plan.first_block :]]
        idx.pin(pinned)
        ok = False
        try:
            await self.client.export_blocks(rank, ids, plan.host_slot)
            ok = self.epoch == epoch
        except _RANK_ERRORS as exc:
            log.warning("L1 write of %d blocks from rank %d failed: %s", len(ids), rank, exc)
            self._maybe_disable_l1(exc)
        finally:
            if self.epoch == epoch:
                idx.release_uses(pinned)
        if ok:
            self.l1.commit(plan, self._clock())
            if self.metrics is not None:
                self.metrics.written_blocks.inc(len(ids))
                self.metrics.written_bytes.inc(len(ids) * int(getattr(self.client, "bytes_per_block", 0) or 0))
        else:
            self.l1.abort(plan)
        return ok

    def _hold_for_export(self, rank: int, victims: list[Node]) -> list[_ChainExport]:
        """Called in the same synchronous step as the eviction of ``victims``: for each owner
        (homed here) whose L1 copy lacks the chain ending at its deepest victim, pin the part
        of that chain still filed in L0. Otherwise another admission could evict and release
        those ancestors before this one's export runs, and the chain (hence the session's L1
        copy) would be lost or cut short: the partial restores seen at 500K x 200. The pins
        end in ``_retire`` once the export is done."""
        if not (victims and self.l1_enabled):
            return []
        deepest: dict[SessionId, Node] = {}
        for node in victims:
            owner = node.owner
            session = self.sessions.get(owner) if owner is not None else None
            if session is None or session.home_rank != rank:
                continue  # nobody will ask for these here again
            if owner not in deepest or node.depth > deepest[owner].depth:
                deepest[owner] = node
        idx = self.l0[rank]
        held = {id(n) for n in victims}
        out: list[_ChainExport] = []
        for owner, node in deepest.items():
            chain_nodes: list[Node] = []
            walk: Node | None = node
            while walk is not None:
                chain_nodes.append(walk)
                walk = walk.parent
            chain_nodes.reverse()
            chain = [n.block_hash for n in chain_nodes]
            if self.l1.holds_chain(owner, chain):
                continue  # already complete in L1: dropping it is free
            filed = [n.block_hash for n in chain_nodes if id(n) not in held]
            assert all(idx.nodes.get(h) is not None for h in filed), "evicted chain not prefix-closed"
            idx.pin(filed)
            out.append(_ChainExport(owner, chain_nodes, filed))
        return out

    async def _retire(
        self, rank: int, victims: list[Node], epoch: int, wait_release: bool = True,
        exports: list[_ChainExport] | None = None,
    ) -> None:
        """Write the evicted blocks' sessions to L1 where it lacks them, then release the blocks.

        ``exports`` are the chains ``_hold_for_export`` pinned when the blocks were evicted. The
        exports are awaited before the release is sent, and the rank applies commands in the
        order sent, so no block is dropped before its copy to L1 (when L1 has room).

        The rank runs commands only between steps, so every round trip here can cost a step:
        the owners' exports go out together (one boundary), and with ``wait_release=False`` the
        release is sent but not waited for, so the caller's next command (an import, a submit)
        rides in the same boundary. The rank applies commands in the order sent, so the blocks
        are free by then; they stay counted as releasing until the reply."""
        exports = exports or []
        try:
            if self.l1_enabled and self.epoch == epoch and exports:
                await asyncio.gather(*[self._retire_owner(rank, ex, epoch) for ex in exports])
        finally:
            if self.epoch == epoch:
                idx = self.l0[rank]
                for ex in exports:
                    idx.release_uses(ex.pinned)
                num_unbacked = 0
                for node in victims:
                    if not self._l1_has_block(node):
                        num_unbacked += 1
                self.num_evicted_unbacked_blocks += num_unbacked
                if self.metrics is not None:
                    self.metrics.evicted_blocks.labels("l0", "false").inc(num_unbacked)
                    self.metrics.evicted_blocks.labels("l0", "true").inc(len(victims) - num_unbacked)
            release = self._release(rank, [n.block_id for n in victims], epoch, counted=True)
            if wait_release:
                await release
            else:
                self._spawn(release)
                await asyncio.sleep(0)  # the task's first step sends the command

    def _plannable_free_blocks(self, rank: int) -> int:
        """Free blocks any planner may take on ``rank`` (negative when running replies' growth
        overcommitted the pool)."""
        ledger = self._ledgers[rank]
        return ledger.free_blocks(len(self.l0[rank])) - self._keep_out_blocks(ledger)

    def _l1_has_block(self, node: Node) -> bool:
        """True when the L1 copy of the block's owner holds it at its place in the chain."""
        if node.owner is None:
            return False
        entry = self.l1.entries.get(node.owner)
        return entry is not None and node.depth < len(entry.hashes) and entry.hashes[node.depth] == node.block_hash

    async def _retire_owner(self, rank: int, ex: _ChainExport, epoch: int) -> None:
        """Write one evicted session's chain to L1 unless it holds it (its filed part is pinned)."""
        if not await self._wait_l1_write(ex.owner, epoch):  # chain after its write in flight
            return
        ok = await self._write_through(rank, ex.owner, [n.block_hash for n in ex.chain_nodes], epoch,
                                       nodes=ex.chain_nodes)
        if not ok:
            self.num_export_failures += 1
            log.debug("L1 copy of evicted session %s on rank %d not written (no room or failed)",
                      ex.owner, rank)

    async def _move(
        self, session: Session, src: int, dst: int, hashes: list[BlockHash], num_src_blocks: int
    ) -> bool:
        """Hand a session from ``src`` to ``dst``: make sure L1 holds its blocks from ``src``;
        its next admission on ``dst`` restores them. Its blocks on ``src`` become free to drop."""
        if num_src_blocks > 0:
            chain = list(hashes[:num_src_blocks])
            if not await self._write_through(src, session.session_id, chain, self.epoch):
                return False
        session.moved_at_s = self._clock()
        session.home_rank = dst
        self._idle.update(session, session.moved_at_s)
        log.info("moved session %s from rank %d to rank %d through L1 (%d blocks)",
                 session.session_id, src, dst, num_src_blocks)
        if self.metrics is not None:
            self.metrics.sessions_moved.inc()
        return True

    async def _prefetch(
        self, session: Session, rank: int, entry: Any, chain: list[BlockHash], first: int,
        anchor: BlockHash | None, epoch: int,
    ) -> None:
        """Import ``chain[first:]`` from ``entry`` (held by ``prefetch``; released here)."""
        ledger = self._ledgers[rank]
        count = len(chain) - first
        try:
            started = self._clock()
            try:
                ids = await self.client.import_blocks(rank, entry.start_slot + first, count)
            finally:
                self.l1.end_read(entry)
            restore_s = self._clock() - started
            if self.epoch != epoch:
                return
            idx = self.l0[rank]
            if anchor is not None and anchor not in idx.nodes:
                self._release_later(rank, ids)  # its parent was evicted meanwhile
                return
            # File them under their filed prefix (an anchored slice is not a chain of its own).
            known = idx.block_ids(chain[:first])
            duplicates = idx.insert(chain, known + list(ids), session.session_id, self._clock())[first:]
            self._release_later(rank, duplicates)
            dup = set(duplicates)
            filed = [h for h, block_id in zip(chain[first:], ids) if block_id not in dup]
            self._prefetched.setdefault(session.session_id, set()).update(filed)
            if self.metrics is not None:
                self.metrics.restored_tokens.inc(len(filed) * self.block_size)
                self.metrics.restore_seconds.observe(restore_s)
        except _RANK_ERRORS as exc:
            log.warning("L1 prefetch on rank %d failed: %s", rank, exc)
            self._maybe_disable_l1(exc)
        finally:
            if self.epoch == epoch:
                ledger.reserved_blocks -= count
            self._prefetches.pop(session.session_id, None)
            self.queue.notify(rank)

    def _session_chain(self, rank: int, session: Session) -> list[BlockHash]:
        """The session's longest chain filed on ``rank`` (ending at one of its tails)."""
        idx = self.l0[rank]
        best: list[BlockHash] = []
        for tail in session.tail_hashes:
            node = idx.nodes.get(tail)
            if node is not None and node.depth + 1 > len(best):
                chain = []
                walk: Node | None = node
                while walk is not None:
                    chain.append(walk.block_hash)
                    walk = walk.parent
                best = chain[::-1]
        return best

    # ================================================================= releases & tasks

    async def _await_releases(self, rank: int, epoch: int, timeout_s: float = 2.0) -> None:
        """Wait (bounded) until no release is pending on ``rank``."""
        loop = asyncio.get_running_loop()  # a wall bound (the loop's time), whatever clock the policy uses
        deadline = loop.time() + timeout_s
        while self.epoch == epoch and self._ledgers[rank].num_releasing > 0 and loop.time() < deadline:
            await asyncio.sleep(0.002)

    def _release_later(self, rank: int, block_ids: list[int]) -> None:
        if block_ids:
            self._ledgers[rank].num_releasing += len(block_ids)
            self._spawn(self._release(rank, block_ids, self.epoch, counted=True))

    async def _release(self, rank: int, block_ids: list[int], epoch: int, counted: bool) -> None:
        try:
            if block_ids and self.epoch == epoch:
                await self.client.release(rank, block_ids)
        except (RankFailed, RankUnavailable) as exc:
            log.info("release of %d blocks on rank %d dropped: %s", len(block_ids), rank, exc)
        finally:
            if counted and self.epoch == epoch:
                self._ledgers[rank].num_releasing -= len(block_ids)
            self.queue.notify(rank)
            self._update_gauges()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("cache background task failed", exc_info=task.exception())

    # ================================================================= state sync

    def _on_restart(self, new_epoch: int) -> None:
        """The rank group restarted: every block id and host slot of the old epoch is gone."""
        log.warning("rank group restarted (epoch %d -> %d): dropping every L0 and L1 entry",
                    self.epoch, new_epoch)
        self.epoch = new_epoch
        for idx in self.l0.ranks:
            idx.remove_all()
        self.l1.clear()
        self.sessions.clear_placement()
        self._idle.clear()
        self._ledgers = [_RankLedger(max(0, self.client.num_blocks - 1)) for _ in range(self.num_ranks)]
        self._prefetches.clear()
        self._prefetched.clear()
        self.l1_off_reason = "not started"
        self._sync_l1()
        self.queue.notify_all()

    def _sync_l1(self) -> None:
        """Adopt the host pool once it exists (it is allocated without blocking startup)."""
        if self.l1_off_reason is None or self.l1_off_reason.startswith("disabled:"):
            return
        slots = int(getattr(self.client, "num_host_slots", 0) or 0)
        if not self.config.l1_cache:
            reason = "l1_cache is false"
        elif not self.config.prefix_cache:
            reason = "prefix_cache is false"
        elif slots <= 0:
            reason = "the rank group has no L1 host pool (yet)"
        else:
            self.l1.resize(slots)
            self.l1_off_reason = None
            log.info("L1 on: %d host slots of %d B", slots, getattr(self.client, "bytes_per_block", 0))
            return
        if reason != self.l1_off_reason:
            log.info("L1 off: %s", reason)
            self.l1_off_reason = reason

    def _maybe_disable_l1(self, exc: BaseException) -> None:
        text = str(exc)
        if isinstance(exc, NotImplementedError) or "no L1 host pool" in text:
            self.l1_off_reason = f"disabled: the engine cannot copy blocks to/from host ({text})"
            log.warning("L1 off: %s", self.l1_off_reason)

    def _forget_idle_sessions(self, now: float) -> None:
        keep = {sid for idx in self.l0.ranks for sid in idx.owners() if sid is not None}
        keep |= set(self.l1.entries)
        for sid in [sid for sid in self._prefetched if self.sessions.get(sid) is None]:
            del self._prefetched[sid]
        for sid in self.sessions.forget_idle(now, self.config.session_forget_s, keep):
            self._idle.remove(sid)

    # ================================================================= helpers

    def _keep_out_blocks(self, ledger: _RankLedger) -> int:
        """Blocks of a rank's pool that admission never plans on: ``reserve_blocks`` of slack
        plus the share above ``usable_fraction`` (DeepInfer's prefill watermark counts cached
        blocks as used, so cached + reserved must stay under it)."""
        cap = ledger.capacity_blocks
        usable = math.floor(cap * self.config.usable_fraction + 1e-9)
        return self.config.reserve_blocks + (cap - usable)

    def _pool_usage(self, rank: int) -> float:
        """Cached + reserved blocks over the blocks the cache may use (``usable_fraction``)."""
        ledger = self._ledgers[rank]
        usable = math.floor(ledger.capacity_blocks * self.config.usable_fraction + 1e-9)
        if usable <= 0:
            return 1.0
        return (len(self.l0[rank]) + ledger.reserved_blocks) / usable

    def _l1_score(self, sid: SessionId) -> float:
        session = self.sessions.get(sid)
        return float("inf") if session is None else session.expected_wait_s(self._clock())

    def _count_lost_prefix(self, session: Session, adm: Admission, hashes: list[BlockHash]) -> None:
        """A turn whose prompt extends a chain its session finished before should start from
        all of it (L0 or restored from L1); count the turns that did not and the tokens lost."""
        if not self.config.prefix_cache or not session.tail_hashes:
            return
        positions = {h: i for i, h in enumerate(hashes)} if len(session.tail_hashes) > 1 else None
        known = 0
        for tail in session.tail_hashes:
            if positions is not None:
                at = positions.get(tail)
            else:
                try:
                    at = hashes.index(tail)
                except ValueError:
                    at = None
            if at is not None:
                known = max(known, at + 1)
        expected = usable_prefix_blocks(known, adm.num_prompt_tokens, self.block_size)
        if adm.num_used_blocks < expected:
            lost = (expected - adm.num_used_blocks) * self.block_size
            self.num_partial_prefix_admissions += 1
            self.num_lost_prefix_tokens += lost
            if self.metrics is not None:
                self.metrics.partial_prefix_admissions.inc()
                self.metrics.lost_prefix_tokens.inc(lost)

    def _count_prefetched(self, adm: Admission, hashes: list[BlockHash]) -> None:
        """Blocks of the admission's resident (L0) prefix that a prefetch restored for this
        session count as L1 hits: they came from host memory, not from the GPU cache."""
        restored = self._prefetched.pop(adm.session_id, None)
        if not restored:
            return
        num_l1_blocks = adm.cached_tokens_by_tier["l1"] // self.block_size
        num_l0_blocks = adm.num_used_blocks - num_l1_blocks  # the L0 part is the chain's start
        num_prefetched = sum(1 for h in hashes[:num_l0_blocks] if h in restored)
        adm.cached_tokens_by_tier["l1"] += num_prefetched * self.block_size
        adm.cached_tokens_by_tier["l0"] -= num_prefetched * self.block_size

    def _observe_admission(self, adm: Admission) -> None:
        m = self.metrics
        if m is None:
            return
        m.admissions.labels("admitted").inc()
        m.prompt_tokens.inc(adm.num_prompt_tokens)
        m.cached_tokens.labels("l0").inc(adm.cached_tokens_by_tier["l0"])
        m.cached_tokens.labels("l1").inc(adm.cached_tokens_by_tier["l1"])
        m.queue_seconds.observe(adm.queue_time_s)
        self._update_gauges()

    def _update_gauges(self) -> None:
        """The state changed: show it in the load gauges soon (``cache/gauges.py``)."""
        if self.metrics is not None:
            self._gauges.changed()

    def _refresh_gauges(self) -> None:
        m = self.metrics
        assert m is not None
        for load, (load_g, free_g, cached_g, depth_g) in zip(self.loads(), self._rank_gauges):
            load_g.set(load.load_tokens)
            free_g.set(load.num_free_blocks)
            cached_g.set(len(self.l0[load.rank]))
            depth_g.set(self.queue.depth(load.rank))
        m.l1_slots.set(self.l1.num_slots)
        m.l1_used_slots.set(self.l1.alloc.num_used_slots)
        m.l1_enabled.set(1 if self.l1_enabled else 0)


__all__ = ["Admission", "CacheManager", "RankIndex"]
