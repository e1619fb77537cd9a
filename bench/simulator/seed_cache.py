"""The seed deployment's cache behaviour, modelled (it is not our code: ours is ``cache/``).

What the seed guide describes: L0 keeps finished prompts' blocks, every turn of a session goes to
the rank holding its prefix, new sessions go to the least-loaded rank; L0 evicts least recently
used sessions when the engine needs room, and "when L0 must evict an idle session, its blocks are
copied to host RAM" (L1); the next turn copies them back (60 ms per 1M tokens). There is no
residency-aware admission: a turn restores at once if blocks can be freed (else it recomputes),
is handed to the engine at once and waits in the engine's FIFO. Where the guide is silent the
model assumes: the L0 keeps DeepInfer's KV usage at its 0.9 watermark by evicting (the scheduler
has no eviction hook), idle sessions go first (least recently used first, so with 3 s pacing the
session about to return goes first), then sessions whose turn is queued in the engine but not
admitted (that turn then prefills its whole prompt); blocks of admitted turns cannot be freed.
Without that last rule the modelled group deadlocks once queued prefixes fill the pool (DeepInfer
would spin on placeholder steps); the seed's run did not hang.

Same facade as ``cache.manager.CacheManager`` (``admit`` / ``finish`` / ``abort``), so the
simulator's agents drive either. Sessions are tracked whole (an agent's prompts only ever extend
its previous prompt + output), so no block hashing is needed here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bench.simulator.engine import SimGroup
from bench.simulator.model import SeedPolicy
from rank.engine import CapacityExhausted, EngineRequest, RequestOutput, SamplingParams, usable_prefix_blocks


@dataclass(slots=True, eq=False)
class _Entry:
    session: str
    rank: int
    blocks: list[int]  # cache-held, covering the first len(blocks) * bs tokens of the session
    num_in_use: int = 0
    last_finish_s: float = 0.0


@dataclass(slots=True, eq=False)
class SeedAdmission:
    rank: int
    session: str
    prefix_blocks: list[int]
    num_cached_tokens: int
    restored_tokens: int = 0
    is_closed: bool = False
    superseded: list[int] = field(default_factory=list)  # old entry blocks past the prefix

    def engine_request(self, request_id: str, prompt_ids: np.ndarray,
                       sampling: SamplingParams) -> EngineRequest:
        return EngineRequest(request_id, prompt_ids, sampling, list(self.prefix_blocks),
                             self.num_cached_tokens)


class SeedCacheManager:
    """Invariant: every block id in an ``_Entry`` holds exactly one cache ref on its rank, and
    entries of one rank never share a block."""

    def __init__(self, group: SimGroup, policy: SeedPolicy, clock: Callable[[], float]) -> None:
        self.group = group
        self.policy = policy
        self.clock = clock
        self.bs = group.block_size
        self.l0: list[OrderedDict[str, _Entry]] = [OrderedDict() for _ in range(group.num_ranks)]
        self.l1: list[OrderedDict[str, int]] = [OrderedDict()
                                                for _ in range(group.num_ranks)]  # session -> blocks
        self.l1_blocks = [0] * group.num_ranks
        self.l1_capacity_blocks = group.deployment.l1_tokens_per_rank // self.bs
        self.home: dict[str, int] = {}
        self.num_dropped_blocks = 0
        self.num_l1_writes = 0
        self.num_restores = 0
        group.pressure_hook = self.evict

    # ------------------------------------------------------------------ facade
    async def admit(self, prompt_ids: np.ndarray, session_hint: str | None,
                    num_output_tokens_hint: int) -> SeedAdmission:
        sid = session_hint or f"anon-{id(prompt_ids)}"
        # The seed routed on the session id alone: a subagent's chain ("<session>/agent:<id>", a
        # prompt of its own) goes to its parent's rank.
        route = sid.split("/agent:", 1)[0]
        rank = self.home.get(route)
        if rank is None:
            rank = self._least_loaded()
            self.home[route] = rank
        n = len(prompt_ids)
        entry = self.l0[rank].get(sid)
        restored = 0
        if entry is None and sid in self.l1[rank]:
            entry, restored = await self._restore(rank, sid)
        adm = SeedAdmission(rank, sid, [], 0)
        if entry is not None:
            self.l0[rank].move_to_end(sid)
            usable = usable_prefix_blocks(len(entry.blocks), n, self.bs)
            adm.prefix_blocks = entry.blocks[:usable]
            adm.num_cached_tokens = usable * self.bs
            adm.restored_tokens = min(restored, adm.num_cached_tokens)
            entry.num_in_use += 1
        return adm

    def finish(self, adm: SeedAdmission, prompt_ids: Sequence[int], output_ids: Sequence[int],
               output: RequestOutput,
               stop_kind: object = None) -> None:
        if adm.is_closed:
            return
        adm.is_closed = True
        l0 = self.l0[adm.rank]
        entry = l0.get(adm.session)
        kept = list(output.kept_blocks)
        # The prefix the engine really started from (gone if L0 dropped it while the turn was
        # queued): those kept blocks are the entry's own, so the new refs are duplicates.
        dup = kept[: output.num_cached_tokens // self.bs]
        assert entry is not None or not dup, ("dup without entry", adm.session, dup[:4])
        assert entry is None or set(dup) <= set(entry.blocks), ("dup not in entry", adm.session)
        if entry is None:
            entry = l0[adm.session] = _Entry(adm.session, adm.rank, [])
        else:
            entry.num_in_use = max(0, entry.num_in_use - 1)
        old = [b for b in entry.blocks if b not in set(kept)]
        self._release(adm.rank, dup + old)
        entry.blocks = kept
        entry.last_finish_s = self.clock()
        l0.move_to_end(adm.session)
        self.l1_drop(adm.rank, adm.session)  # the L1 copy is stale now

    def abort(self, adm: SeedAdmission) -> None:
        if adm.is_closed:
            return
        adm.is_closed = True
        entry = self.l0[adm.rank].get(adm.session)
        if entry is not None:
            entry.num_in_use = max(0, entry.num_in_use - 1)

    # ------------------------------------------------------------------ internals
    def _least_loaded(self) -> int:
        loads = []
        for rank in range(self.group.num_ranks):
            st = self.group.stats(rank)
            cached = sum(len(e.blocks) for e in self.l0[rank].values()) * self.bs
            loads.append((st.running_tokens + st.waiting_tokens + cached, rank))
        return min(loads)[1]

    def _release(self, rank: int, ids: list[int]) -> None:
        r = self.group.ranks[rank]
        for b in ids:
            r.cache_refs[b] -= 1
            assert r.cache_refs[b] >= 0
            if r.cache_refs[b] == 0 and r.seq_refs[b] == 0:
                r.free.append(b)

    def evict(self, rank: int, num_blocks: int) -> int:
        """LRU: free at least ``num_blocks`` blocks. Sessions with no turn in flight go first,
        least recently used first, whether or not they are about to return. When that is not
        enough, sessions whose turn still waits in the engine's queue go next (that turn then
        prefills its whole prompt; with ``strip_queued='idle_rank'`` only while nothing runs on
        the rank); blocks of an admitted or running turn cannot be freed."""
        freed = 0
        l0 = self.l0[rank]
        for queued in (False, True):
            if queued and self.policy.strip_queued == "idle_rank" and (
                self.group.ranks[rank].running or self.group.ranks[rank].in_step
            ):
                break  # running turns will end and release their blocks: wait for them
            for sid in list(l0):
                if freed >= num_blocks:
                    return freed
                entry = l0[sid]
                if bool(entry.num_in_use) != queued:
                    continue
                if queued and not self.group.unpin_waiting(rank, entry.blocks):
                    continue
                del l0[sid]
                if entry.blocks:  # "when L0 must evict an idle session, its blocks are copied to host RAM"
                    self._l1_put(rank, sid, len(entry.blocks))
                before = len(self.group.ranks[rank].free)
                self._release(rank, entry.blocks)
                freed += len(self.group.ranks[rank].free) - before
        return freed

    def _l1_put(self, rank: int, sid: str, num_blocks: int) -> None:
        l1 = self.l1[rank]
        self.l1_drop(rank, sid)
        while l1 and self.l1_blocks[rank] + num_blocks > self.l1_capacity_blocks:
            _old, n = l1.popitem(last=False)
            self.l1_blocks[rank] -= n
        if num_blocks <= self.l1_capacity_blocks:
            l1[sid] = num_blocks
            self.l1_blocks[rank] += num_blocks
            self.num_l1_writes += 1

    def l1_drop(self, rank: int, sid: str) -> None:
        n = self.l1[rank].pop(sid, None)
        if n is not None:
            self.l1_blocks[rank] -= n

    async def _restore(self, rank: int, sid: str) -> tuple[_Entry | None, int]:
        num = self.l1[rank][sid]
        free = len(self.group.ranks[rank].free)
        if num > free:
            self.evict(rank, num - free)
        try:
            ids = await self.group.import_blocks(rank, 0, num)
        except CapacityExhausted:
            return None, 0
        self.l1_drop(rank, sid)
        entry = _Entry(sid, rank, ids, last_finish_s=self.clock())
        stale = self.l0[rank].pop(sid, None)  # a concurrent turn may have refiled it meanwhile
        if stale is not None:
            entry.num_in_use = stale.num_in_use
            self._release(rank, stale.blocks)
        self.l0[rank][sid] = entry
        self.num_restores += 1
        return entry, num * self.bs
