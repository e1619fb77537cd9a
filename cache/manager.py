"""``CacheManager``: the facade the server's service uses for every turn.

One turn::

    cache.prefetch(session_hint)                 # optional, as soon as the headers are read
    async with cache.turn(prompt_ids, session_hint, max_tokens) as turn:
        sampling = SamplingParams(max_tokens=turn.admission.max_output_tokens, ...)
        async for out in client.submit(turn.rank, turn.engine_request(request_id, sampling)):
            turn.feed(out)                       # keeps it; grows the KV room ahead of decode
        turn.stop_kind = stop_kind               # filed on exit; aborted on an exception

``turn`` admits on enter and settles exactly once (``cache/turns.py``): ``finish`` on a normal
exit, ``abort`` on an exception or a cancellation. ``admit`` hashes the prompt, finds (or
creates) the session, routes it (``router.py``), waits for room (``admission.py`` orders the
waiters; ``planner.py`` asks, then commits: pins the L0 prefix, evicts by value, never a session
about to return, reserves), restores blocks from L1 when the host pool holds more of the prefix
than the GPU (``l1_restores.py``), and returns an ``Admission`` holding use refs on the prefix.
``finish`` files the finished turn's kept blocks (duplicates released to the rank), releases the
use refs, learns the session's stop kind and queues the write-through of its new blocks to L1 (and
L2 behind it; ``l1_write_watermark``, 0 by default: every turn). ``abort`` only releases. A
second settle of one admission is a no-op.

The parts, one job each, share ``cache/state.py`` (which says who owns each counter): the
rank admitter (``rank_admission.py``) and its planner, the L1 copies (``l1_writes.py`` to L1,
``l1_restores.py`` from it, ``retire.py`` for evicted blocks), the release ledger
(``releases.py``), the output room (``output_room.py``), the restart sync (``restart.py``) and
the gauges (``gauges.py``; the manager only notifies them).

Accounting (``check_balance`` asserts it once quiescent): per rank, blocks filed in the L0 index
== blocks the engine holds a cache ref on; the ledger's sums (``cache/ledger.py``: reserved
blocks and running tokens == what plans and prefetches hold + the open admissions' shares); no
use refs without an open admission; L1 slots in use == the extents of its entries. A rank
restart (new epoch) forgets every L0 entry (L1's committed entries outlive it), and admissions
of the old epoch are closed without touching the new engines.
With an L2 store (``l2``), L1 writes spill to disk and restores fill L1 from it
(``cache/kv_tier.py``); ``close`` writes idle sessions out at a graceful stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np

from cache.admission import AdmissionQueue
from cache.branches import Branches
from cache.config import CacheConfig
from cache.eviction import EvictionPolicy
from cache.gauges import CacheGauges
from cache.hashing import BlockHash, ChainHasher, as_token_array
from cache.idle_load import IdleLoad
from cache.kv_tier import KVTier
from cache.l0_index import L0Index
from cache.l1_index import L1Index
from cache.l1_restores import L1Restores
from cache.l1_writes import L1Writes
from cache.metrics import CacheMetrics
from cache.output_room import OutputRoom, output_limit
from cache.planner import AdmitPlanner, known_prefix_blocks
from cache.rank_admission import RankAdmitter
from cache.restart import RestartSync, sync_l1
from cache.retire import Retirer
from cache.router import RankLoad, Router
from cache.sessions import Session, SessionHint, SessionTable, StopKind, session_id_for_hint
from cache.state import CacheState
from cache.turns import Admission, Tier, TierTokens, Turn
from protocol.errors import InvalidRequest, PromptTooLong
from rank.client import GroupState, RankClient
from rank.engine import RequestOutput, usable_prefix_blocks
from rank.ids import Rank

log = logging.getLogger(__name__)


class CacheManager:
    """See the module docstring. One event loop; not thread-safe."""

    def __init__(
        self,
        client: RankClient,
        config: CacheConfig,
        metrics: CacheMetrics | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        l2: KVTier | None = None,
    ) -> None:
        # prefix_cache_supported: only the DeepInfer group may say False (no prefix-cache patch).
        if config.prefix_cache and not client.prefix_cache_supported:
            # The engine cannot start from cached blocks: no L0, and hence no L1 (sync_l1).
            reason = client.prefix_cache_reason or "not supported by the engine"
            log.warning("prefix cache (L0) and L1 off: %s", reason)
            config = config.model_copy(update={"prefix_cache": False})
        self.client = client
        self.config = config
        self.metrics = metrics
        self.block_size = client.block_size
        self.num_ranks = client.num_ranks
        self.hasher = ChainHasher(client.block_size, config.hash_salt.encode())
        # L2 below L1 (``cache/kv_tier.py``), only with the prefix cache on
        self.state = state = CacheState(client, config, metrics, clock,
                                        tier=l2 if config.prefix_cache else None, root=self.hasher.root)
        self.router = Router(config.router(), client.block_size)
        self.writes = L1Writes(state)
        self.restores = L1Restores(state, self.writes)
        self.retirer = Retirer(state, self.writes)
        self.planner = AdmitPlanner(state, self.retirer)
        self.output_room = OutputRoom(state, self.retirer)
        self.admitter = RankAdmitter(state, self.planner, self.retirer, self.restores)
        self._num_finished = 0
        # Admissions that got less of their session's known prefix than it had computed.
        self.num_partial_prefix_admissions = 0
        self.num_lost_prefix_tokens = 0
        self.branches = Branches(state, self.writes)
        if metrics is not None:
            state.notify_changes_to(CacheGauges(metrics, state, self.loads).changed)
        self._restart = RestartSync(state, self.restores.reset)
        client.add_restart_listener(self._restart.on_restart)
        sync_l1(state)

    # ================================================================= views of the shared state

    @property
    def sessions(self) -> SessionTable:
        return self.state.sessions

    @property
    def l0(self) -> L0Index:
        return self.state.l0

    @property
    def l1(self) -> L1Index:
        return self.state.l1

    @property
    def l1_enabled(self) -> bool:
        return self.state.l1_enabled

    @property
    def l1_off_reason(self) -> str | None:
        return self.state.l1_off_reason

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def policy(self) -> EvictionPolicy:
        return self.state.policy

    @property
    def queue(self) -> AdmissionQueue:
        return self.state.queue

    @property
    def idle_load(self) -> IdleLoad:
        return self.state.sessions.idle

    @property
    def num_evicted_unbacked_blocks(self) -> int:
        return self.retirer.num_evicted_unbacked_blocks

    @property
    def num_export_failures(self) -> int:
        return self.retirer.num_export_failures

    @property
    def num_open_turns(self) -> int:
        return len(self.admitter.open)

    @property
    def num_background_tasks(self) -> int:
        return len(self.state.tasks)

    # ================================================================= turns

    @contextlib.asynccontextmanager
    async def turn(
        self, prompt_ids: np.ndarray | Sequence[int], session_hint: SessionHint | str | None, max_tokens: int,
        *, max_tokens_is_default: bool = False, caller_salt: bytes = b"",
    ) -> AsyncIterator[Turn]:
        """Admit a turn for the ``async with`` block and settle it when the block ends.
        ``caller_salt``: blocks are shared only with turns of the same salt (b"": everyone's)."""
        tokens = as_token_array(prompt_ids)
        adm = await self.admit(tokens, session_hint, max_tokens, max_tokens_is_default=max_tokens_is_default,
                               caller_salt=caller_salt)
        turn = Turn(self, adm, tokens)
        ok = False
        try:
            yield turn
            ok = True
        finally:
            turn.exit(ok)

    def prefetch(self, session_hint: SessionHint | str | None) -> None:
        """Start restoring a known session's blocks from L1 to its rank before its prompt is
        tokenized (the service calls this as soon as it has read the headers)."""
        session_hint = SessionHint.of(session_hint)
        if not session_hint.key or not self.config.prefix_cache or not self.l1_enabled:
            return
        session = self.sessions.get(session_id_for_hint(session_hint))
        if session is not None:
            self.restores.start_prefetch(session)

    async def admit(
        self, prompt_ids: np.ndarray | Sequence[int], session_hint: SessionHint | str | None, max_tokens: int,
        *, max_tokens_is_default: bool = False, caller_salt: bytes = b"",
    ) -> Admission:
        """Route, pin, queue if needed, restore; see the module docstring. A turn whose prompt
        plus ``max_tokens`` cannot fit a rank's usable pool is refused before it queues
        (``cache/output_room.py``), unless ``max_tokens`` is a default: then it is trimmed.
        Prefer ``turn``, which settles the admission; ``admit`` leaves that to the caller."""
        s = self.state
        tokens = as_token_array(prompt_ids)
        if tokens.size == 0:
            raise InvalidRequest("prompt is empty", param="messages")
        # A running sequence holds all its blocks (shared prefix ones too), so a turn must fit a
        # rank's usable pool whole (every rank has the same pool).
        limit = s.ledgers[0].usable_blocks()
        if -(-(len(tokens) + 1) // self.block_size) > limit:
            raise PromptTooLong(len(tokens), max(0, limit * self.block_size - 1))
        max_output = output_limit(len(tokens), max(1, max_tokens), limit * self.block_size,
                                  max_tokens_is_default)
        now = s.clock()
        sync_l1(s)
        hashes = self.hasher.hashes(tokens, caller_salt) if self.config.prefix_cache else []
        hint = SessionHint.of(session_hint)
        if not self.config.branch_routing:
            hint = SessionHint(key=hint.key)  # one routing unit per session key
        session = self.sessions.resolve(hint, hashes, now, lambda s: self.branches.continues(s, hashes),
                                        detect=self.config.branch_routing)
        retired = self.sessions.take_retired(session, hint, self.branches.prefix_broken(session, hashes))
        if retired:
            self.branches.retire(session, retired, hashes)
        self.sessions.record_arrival(session, now, len(tokens))
        if s.l2 is not None and s.l2.shared and hashes:  # a store other nodes write to (L3): ask it
            await s.l2.probe(hashes, max(self.l0.match_all(hashes)))
        await self.restores.await_prefetch(session.session_id)
        matches = self.l0.match_all(hashes)
        can_move = self.l1_enabled and self.config.prefix_cache
        l1_blocks = self.l1.match(hashes)[1] if can_move and hashes else 0
        decision = self.router.route(session, matches, len(tokens), self.loads(), can_move, now, l1_blocks)
        ranks = decision.candidates
        src = decision.move_from
        if src is not None and not await self.writes.move(session, src, ranks[0], hashes, matches[src]):
            ranks = (src,)
        self.sessions.turn_started(session, now, home=ranks[0] if len(ranks) == 1 else None)
        try:
            if decision.copy_from is not None:
                await self.branches.copy_prefix(session, decision, hashes, len(tokens))
            num_reserve = min(max_output, self.config.output_reserve_tokens)
            adm = await self.admitter.admit_on(
                ranks, session, tokens, hashes, num_reserve,
                order=lambda: self.router.bind_order(self.loads(), matches, len(tokens)),
                worst_output=num_reserve if max_tokens_is_default else max_output,
            )
            adm.max_output_tokens = max_output
            adm.caller_salt = caller_salt
            if session.home_rank != adm.rank:  # late binding: the rank that had room first
                self.sessions.set_home(session, adm.rank, s.clock())
        except BaseException:
            self.sessions.turn_ended(session, s.clock())
            if self.metrics is not None:
                self.metrics.admissions.labels("rejected").inc()
            raise
        self.restores.take_prefetched(adm, hashes)
        self._count_lost_prefix(session, adm, hashes)
        self.admitter.open.add(adm)
        self._observe_admission(adm)
        if self.metrics is not None:
            self.metrics.routed_turns.labels(str(adm.rank), decision.reason.value,
                                             session.request_class.value).inc()
        return adm


    def finish(
        self,
        admission: Admission,
        prompt_ids: np.ndarray | Sequence[int],
        output_ids: np.ndarray | Sequence[int],
        output: RequestOutput,
        stop_kind: StopKind = StopKind.UNKNOWN,
    ) -> None:
        """The turn ended with ``output`` (its terminal RequestOutput): file its kept blocks."""
        s = self.state
        num_known = admission.num_used_blocks  # filed and pinned until close, no await between
        if not self.admitter.close(admission):
            return
        rank = admission.rank
        kept = list(output.kept_blocks)
        now = s.clock()
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
                s.releases.release_later(rank, kept)
            else:
                full = np.concatenate([as_token_array(prompt_ids), as_token_array(output_ids)])
                full_hashes = self.hasher.extend(admission.hashes, full, admission.caller_salt)[: len(kept)]
                duplicates = self.l0[rank].insert(
                    full_hashes, kept, admission.session_id, now, num_known=num_known
                )
                if self.metrics is not None and duplicates:
                    self.metrics.duplicate_blocks.inc(len(duplicates))
                s.releases.release_later(rank, duplicates)
        session = self.sessions.get(admission.session_id)
        if session is not None:
            tail = full_hashes[-1] if full_hashes else None
            self.sessions.record_finish(session, stop_kind, tail, num_tokens, now)
        if full_hashes and self.l1_enabled and s.ledgers[rank].pool_usage() >= self.config.l1_write_watermark:
            self.writes.write_through_later(rank, admission.session_id, full_hashes)
        self._num_finished += 1
        if self._num_finished % 64 == 0:
            self._forget_idle_sessions(now)
        self.queue.notify(rank)
        s.on_change()

    def make_room(self, admission: Admission, num_output_tokens: int) -> None:
        """A running turn has produced ``num_output_tokens``: grow its KV reservation ahead of
        its decode, evicting idle blocks if needed (``cache/output_room.py``). The service calls
        this as outputs arrive; it returns at once while the reservation has room to spare."""
        if self.output_room.needs_room(admission, num_output_tokens):
            self.output_room.grow(admission, num_output_tokens)

    def abort(self, admission: Admission) -> None:
        """The turn will not produce a terminal output to file (submit failed, the rank group
        failed, or the service gave up): release what the admission holds."""
        if self.admitter.close(admission):
            self.queue.notify(admission.rank)

    # ================================================================= load, moves, upkeep

    def loads(self) -> list[RankLoad]:
        """The router's load measure per rank (documented in ``router.py``). O(ranks): the idle
        term is kept incrementally (``cache/idle_load.py``, exact, no approximation)."""
        s = self.state
        idle = s.sessions.idle.tokens(s.clock())
        return [
            RankLoad(Rank(rank), ledger.running_tokens,
                     self.queue.waiting_tokens(rank) + self.branches.placing[rank], idle[rank],
                     ledger.free_blocks())
            for rank, ledger in enumerate(s.ledgers)
        ]

    async def rebalance(self) -> int:
        """Move idle sessions off overloaded ranks through L1. Returns how many moved."""
        if not (self.l1_enabled and self.config.prefix_cache):
            return 0
        moved = 0
        now = self.state.clock()
        for session in sorted(self.sessions, key=lambda s: (-s.context_tokens, s.session_id)):
            src = session.home_rank
            if src is None or session.num_in_flight:
                continue
            chain = self.writes.session_chain(src, session)
            if not chain:
                continue  # nothing resident to move (its next turn is placed by load anyway)
            matched = [len(chain) if r == src else 0 for r in range(self.num_ranks)]
            decision = self.router.route(session, matched, 0, self.loads(), True, now)
            if decision.move_from is None:
                continue
            if await self.writes.move(session, src, decision.rank, chain, len(chain)):
                moved += 1
        return moved

    async def move_session(self, session_hint: str, dst: int) -> bool:
        """Hand an idle session to rank ``dst`` through L1 (operators and tests; ``rebalance``
        does this by load). Its next turn restores its blocks on ``dst``."""
        session = self.sessions.get(session_id_for_hint(session_hint))
        if session is None or session.home_rank is None or session.num_in_flight:
            return False
        if not 0 <= dst < self.num_ranks:
            raise ValueError(f"rank {dst} outside 0..{self.num_ranks - 1}")
        if dst == session.home_rank or not self.l1_enabled:
            return dst == session.home_rank
        chain = self.writes.session_chain(session.home_rank, session)
        return await self.writes.move(session, session.home_rank, Rank(dst), chain, len(chain))

    async def close(self, flush_s: float = 30.0) -> None:
        """Graceful stop (the runtime calls it before it stops the ranks): with L2 on, idle
        sessions only on a GPU go through L1 to disk for at most ``flush_s``, so the next
        backend start with the same ``l2_dir`` restores them."""
        l2 = self.state.l2
        if l2 is None or not self.l1_enabled:
            return
        await self.drain()  # L1 writes and their spills in flight (they need no rank once copied)
        started = self.state.clock()
        if self.client.state != GroupState.READY:  # a failed group: only what L1 holds reaches disk
            log.warning("L2 flush at stop skipped: the rank group is %s", self.client.state.value)
        else:
            try:
                await asyncio.wait_for(self.writes.flush_to_l2(), flush_s)
            except asyncio.TimeoutError:
                log.warning("L2 flush at stop cut off after %.0f s: the remaining sessions restart cold",
                            flush_s)
        await self.drain()
        log.info("L2 at stop: %d blocks spilled by this backend; flush took %.1f s",
                 l2.counters.spilled_blocks, self.state.clock() - started)

    async def drain(self) -> None:
        """Wait for background work (releases, write-throughs, prefetches) to finish."""
        await self.state.tasks.drain()

    def check_balance(self) -> None:
        """Assert the accounting invariants (tests call it after ``drain`` with no turn open)."""
        s = self.state
        s.sessions.idle.check(s.clock())
        quiet = not s.tasks
        for rank, idx in enumerate(self.l0.ranks):
            idx.check()
            open_here = [a for a in self.admitter.open if a.rank == rank and a.epoch == s.epoch]
            s.ledgers[rank].check(open_here, quiet)
            if quiet:
                assert s.releases.pending(rank) == 0, (
                    f"rank {rank}: {s.releases.pending(rank)} releases pending"
                )
                stats = self.client.stats(Rank(rank))
                assert stats.num_cached_blocks == len(idx), (
                    f"rank {rank}: engine holds {stats.num_cached_blocks} cached blocks, index {len(idx)}"
                )
            if not open_here and quiet:
                in_use = [n.block_id for n in idx.nodes.values() if n.use_count]
                assert not in_use, f"rank {rank}: use refs leaked on blocks {in_use[:8]}"
        self.l1.check()
        if quiet:
            assert not self.l1.num_pending_writes, "L1 writes pending with no task"
            held = [e.session_id for e in self.l1.entries.values() if e.num_holds]
            assert not held, f"L1 entries still held: {held[:4]}"

    # ================================================================= bookkeeping

    def _forget_idle_sessions(self, now: float) -> None:
        keep = {sid for idx in self.l0.ranks for sid in idx.owners() if sid is not None}
        keep |= set(self.l1.entries)
        self.restores.forget_gone_sessions()
        self.sessions.forget_idle(now, self.config.session_forget_s, keep)

    def _count_lost_prefix(self, session: Session, adm: Admission, hashes: list[BlockHash]) -> None:
        """A turn whose prompt extends a chain its session finished before should start from
        all of it (L0 or restored from L1); count the turns that did not and the tokens lost."""
        if not self.config.prefix_cache or not session.tail_hashes:
            return
        known = known_prefix_blocks(session.tail_hashes, hashes)
        expected = usable_prefix_blocks(known, adm.num_prompt_tokens, self.block_size)
        num_used = adm.num_cached_tokens // self.block_size  # with a folded restore's blocks
        if num_used < expected:
            lost = (expected - num_used) * self.block_size
            self.num_partial_prefix_admissions += 1
            self.num_lost_prefix_tokens += lost
            if self.metrics is not None:
                self.metrics.partial_prefix_admissions.inc()
                self.metrics.lost_prefix_tokens.inc(lost)

    def _observe_admission(self, adm: Admission) -> None:
        m = self.metrics
        if m is None:
            return
        m.admissions.labels("admitted").inc()
        m.prompt_tokens.inc(adm.num_prompt_tokens)
        for tier, num_tokens in adm.cached_tokens_by_tier.items():
            m.cached_tokens.labels(tier.value).inc(num_tokens)
        m.queue_seconds.observe(adm.queue_time_s)
        self.state.on_change()


__all__ = ["Admission", "CacheManager", "Tier", "TierTokens", "Turn"]
