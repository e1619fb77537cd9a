"""L1: which session's blocks live where in the shared host pool (backend-side bookkeeping).

The pool (``rank/host_pool.py``, mapped by every rank process) is ``[num_slots, bytes_per_block]``.
Each session has at most one *entry*: one contiguous extent of slots holding the KV of its chain
blocks ``0 .. n-1`` in order, so a restore of blocks ``a .. b`` is one import of the consecutive
slots ``start+a .. start+b`` (one DMA + one scatter on the GPU). Extents are allocated with
headroom (``headroom_fraction``, at least ``min_headroom_blocks``) so the next turns of a growing
session are written in place: a write copies only the blocks after the longest common prefix of
the entry and the new chain (the entry is cut back to that prefix first: an agent's next prompt
often does not reproduce the last kept block, whose tokens include the model's output). When the
extent is full it grows in place if the slots after it are free; otherwise the session is written
again into a new extent with ``regrow_fraction`` headroom (geometric, so the whole-chain copies of
a growing session add up to at most ``1 + 1/regrow_fraction`` times its final length) and the old
one is freed once the new one is complete. Bytes written per session are O(its blocks), not
O(turns x blocks).

Invariants (``check``):

* An entry's ``hashes`` are readable: their bytes are in place. Blocks being written are in a
  ``WritePlan`` and only become readable (filed in ``_by_hash``) at ``commit``.
* ``_by_hash[h]`` holds exactly the live entries whose readable chain contains ``h``. Every
  entry holds its chain from block 0, so readable blocks are prefix-closed per chain and
  ``match`` is a binary search.
* An entry with holds (an import reading it, or an export appending to it) is never freed:
  ``drop`` unlinks it from the index at once and frees its slots when the last hold ends, so a
  copy in flight never lands in slots that were handed to another session.
* Slots in use = sum of the capacities of live and unlinked-but-read entries and of pending new
  extents; ``check`` compares this with the allocator.
* ``generation`` moves on ``clear`` and ``keep_across_restart`` (a rank restart): plans and
  reads from before it are void; the latter keeps every entry's readable chain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache.extents import ExtentAllocator
from cache.hashing import BlockHash, common_prefix, filed_prefix_length
from cache.sessions import SessionId
from rank.ids import HostSlot


@dataclass(slots=True, eq=False)
class L1Entry:
    session_id: SessionId
    start_slot: int
    capacity_blocks: int
    hashes: list[BlockHash]  # readable chain blocks 0 .. len-1, at slots start .. start+len-1
    last_used_s: float
    generation: int
    num_holds: int = 0  # imports reading it + exports appending to it
    is_linked: bool = True  # False once dropped; slots freed when num_holds reaches 0


@dataclass(slots=True, eq=False)
class WritePlan:
    """Copy ``block ids of hashes[first_block:]`` from a rank into slots from ``host_slot``."""

    entry: L1Entry  # the entry written (the live one when appending in place, else a new one)
    hashes: list[BlockHash]  # the full chain the entry holds after commit
    first_block: int
    generation: int
    replaces: L1Entry | None = None  # the session's old entry, dropped at commit
    is_cancelled: bool = False  # the session was dropped meanwhile: commit acts as abort

    @property
    def host_slot(self) -> HostSlot:
        return HostSlot(self.entry.start_slot + self.first_block)

    @property
    def num_blocks(self) -> int:
        return len(self.hashes) - self.first_block


@dataclass(slots=True)
class L1Stats:
    num_slots: int
    num_used_slots: int
    num_entries: int
    num_free_extents: int
    largest_free_extent: int
    num_readable_blocks: int = 0


class L1Index:
    def __init__(
        self, num_slots: int, headroom_fraction: float = 0.125, min_headroom_blocks: int = 16,
        regrow_fraction: float = 0.5,
    ) -> None:
        self.alloc = ExtentAllocator(num_slots)
        self.headroom_fraction = headroom_fraction
        self.min_headroom_blocks = min_headroom_blocks
        self.regrow_fraction = max(regrow_fraction, headroom_fraction)
        self.entries: dict[SessionId, L1Entry] = {}
        self._by_hash: dict[BlockHash, dict[SessionId, L1Entry]] = {}
        self._pending: dict[SessionId, WritePlan] = {}
        self._unlinked: list[L1Entry] = []  # dropped while held
        self._cancelled: list[WritePlan] = []  # new-extent writes whose session was dropped
        self.generation = 0

    @property
    def num_slots(self) -> int:
        return self.alloc.num_slots

    # ----------------------------------------------------------------- lookups

    def match(self, hashes: Sequence[BlockHash]) -> tuple[L1Entry | None, int]:
        """The entry holding the longest prefix of ``hashes`` and that prefix's length."""
        lo = filed_prefix_length(hashes, self._by_hash)
        if lo == 0:
            return None, 0
        holders = self._by_hash[hashes[lo - 1]]
        return max(holders.values(), key=lambda e: (e.last_used_s, e.start_slot)), lo

    def backed_blocks(self, session_id: SessionId) -> int:
        entry = self.entries.get(session_id)
        return len(entry.hashes) if entry is not None else 0

    def is_writing(self, session_id: SessionId) -> bool:
        return session_id in self._pending

    @property
    def num_pending_writes(self) -> int:
        """Writes planned and neither committed nor aborted yet."""
        return len(self._pending)

    def holds_block(self, session_id: SessionId, depth: int, block_hash: BlockHash) -> bool:
        """True when the session's entry holds ``block_hash`` (readable) at ``depth`` of its chain."""
        entry = self.entries.get(session_id)
        return entry is not None and depth < len(entry.hashes) and entry.hashes[depth] == block_hash

    def holds_chain(self, session_id: SessionId, hashes: Sequence[BlockHash]) -> bool:
        """True when the session's entry holds ``hashes`` (readable) as a prefix of its chain."""
        entry = self.entries.get(session_id)
        n = len(hashes)
        return entry is not None and n <= len(entry.hashes) and (n == 0 or entry.hashes[n - 1] == hashes[-1])

    # ----------------------------------------------------------------- writes

    def plan_write(
        self,
        session_id: SessionId,
        hashes: Sequence[BlockHash],
        now_s: float,
        score: Callable[[SessionId], float] | None = None,
    ) -> WritePlan | None:
        """Reserve slots to hold ``hashes`` (a session's chain) and say which blocks to copy.

        Only the blocks after the longest common prefix of the session's entry and ``hashes``
        are copied (``first_block``), in place when the extent holds the chain (grown in place
        if possible); the entry is cut back to that prefix at once, as those slots are about to
        be overwritten. A cut needs no read in flight on the entry; with one, or when the extent
        cannot grow, the whole chain goes to a new extent (``replaces`` the old at commit).

        Returns None when nothing needs writing (``holds_chain``), a write is already in flight
        for the session (the caller waits for it and asks again), or no extent can be found even
        after evicting entries by ``score`` (higher = less valuable; entries being read or
        written are never evicted)."""
        n = len(hashes)
        if n == 0 or session_id in self._pending or self.alloc.num_slots == 0:
            return None
        hashes = list(hashes)
        old = self.entries.get(session_id)
        regrow = False
        if old is not None:
            old.last_used_s = now_s
            k = common_prefix(old.hashes, hashes)
            if k == n:
                return None  # the entry holds the chain already
            if k > 0 and n > old.capacity_blocks:
                grown = self._grown(n)
                if self.alloc.try_extend(old.start_slot, old.capacity_blocks, grown):
                    old.capacity_blocks = grown
                else:
                    regrow = True
            cut_ok = k == len(old.hashes) or old.num_holds == 0  # no import reads slots >= k
            if k > 0 and n <= old.capacity_blocks and cut_ok:
                self._truncate(old, k)
                old.num_holds += 1
                plan = WritePlan(old, hashes, k, self.generation)
                self._pending[session_id] = plan
                return plan
        start, capacity = self._allocate(n, score, exclude=session_id, regrow=regrow)
        if start is None:
            return None
        entry = L1Entry(session_id, start, capacity, [], now_s, self.generation, is_linked=False)
        plan = WritePlan(entry, hashes, 0, self.generation, replaces=old)
        self._pending[session_id] = plan
        return plan

    def commit(self, plan: WritePlan, now_s: float) -> None:
        """The copy of ``plan`` completed: its blocks become readable."""
        if plan.generation != self.generation:
            return
        if plan.is_cancelled:
            self.abort(plan)
            return
        assert self._pending.get(plan.entry.session_id) is plan
        del self._pending[plan.entry.session_id]
        entry = plan.entry
        if plan.first_block > 0:
            self._release_hold(entry)
            if not entry.is_linked:
                return
        if plan.replaces is not None and plan.replaces.is_linked:
            self._unlink(plan.replaces)
        if not entry.is_linked:
            entry.is_linked = True
            self.entries[entry.session_id] = entry
        sid = entry.session_id
        for h in plan.hashes[len(entry.hashes) :]:
            self._by_hash.setdefault(h, {})[sid] = entry
        entry.hashes = plan.hashes
        entry.last_used_s = now_s

    def abort(self, plan: WritePlan) -> None:
        """The copy failed: forget the plan (a new extent is freed; an in-place one keeps its size)."""
        if plan.generation != self.generation:
            return
        if self._pending.get(plan.entry.session_id) is plan:
            del self._pending[plan.entry.session_id]
        if plan.first_block > 0:
            self._release_hold(plan.entry)
        else:
            if plan.is_cancelled:
                self._cancelled.remove(plan)
            self.alloc.free(plan.entry.start_slot, plan.entry.capacity_blocks)

    # ----------------------------------------------------------------- reads

    def begin_read(self, entry: L1Entry) -> None:
        assert entry.is_linked and entry.generation == self.generation
        entry.num_holds += 1

    def end_read(self, entry: L1Entry) -> None:
        if entry.generation != self.generation:
            return
        self._release_hold(entry)

    def _release_hold(self, entry: L1Entry) -> None:
        assert entry.num_holds > 0
        entry.num_holds -= 1
        if entry.num_holds == 0 and not entry.is_linked:
            self._unlinked.remove(entry)
            self.alloc.free(entry.start_slot, entry.capacity_blocks)

    # ----------------------------------------------------------------- removal

    def drop(self, session_id: SessionId) -> bool:
        """Forget a session's blocks (a write in flight for it is cancelled at its commit)."""
        plan = self._pending.pop(session_id, None)
        if plan is not None:
            plan.is_cancelled = True
            if plan.first_block == 0:
                self._cancelled.append(plan)
        entry = self.entries.get(session_id)
        if entry is None:
            return plan is not None
        self._unlink(entry)
        return True

    def evict(self, num_slots: int, score: Callable[[SessionId], float] | None) -> int:
        """Drop entries (least valuable first) until an extent of ``num_slots`` fits. Returns
        the number of entries dropped."""
        return self._make_room(num_slots, score, exclude=None)

    def clear(self) -> None:
        """Forget everything (rank restart): slots all free, outstanding plans and reads void."""
        self.generation += 1
        self.entries.clear()
        self._by_hash.clear()
        self._pending.clear()
        self._unlinked.clear()
        self._cancelled.clear()
        self.alloc = ExtentAllocator(self.alloc.num_slots)

    def keep_across_restart(self) -> int:
        """A rank-group restart: the pool's bytes survive (the group keeps its file; see
        ``rank/group.py``), every copy in flight died with the ranks. Keep each entry's readable
        chain, as a new entry object of a new generation, so the old epoch's ``end_read``,
        ``commit`` and ``abort`` calls are no-ops; free the slots of writes in flight (an
        in-place append was cut back to its readable prefix when it was planned, so nothing
        half-written is readable) and of dropped entries still held. Returns the entries kept."""
        old = [e for e in self.entries.values() if e.hashes]
        self.clear()
        kept = [L1Entry(e.session_id, e.start_slot, e.capacity_blocks, list(e.hashes), e.last_used_s,
                        self.generation) for e in old]
        if kept:
            self.alloc.allocate(self.alloc.num_slots)  # all taken; then give back the gaps
            end = 0
            for entry in sorted(kept, key=lambda e: e.start_slot):
                if entry.start_slot > end:
                    self.alloc.free(end, entry.start_slot - end)
                end = entry.start_slot + entry.capacity_blocks
            if end < self.alloc.num_slots:
                self.alloc.free(end, self.alloc.num_slots - end)
        for entry in kept:
            self.entries[entry.session_id] = entry
            for h in entry.hashes:
                self._by_hash.setdefault(h, {})[entry.session_id] = entry
        return len(kept)

    def resize(self, num_slots: int) -> None:
        """Adopt a pool size (the pool is allocated in the background; 0 until it exists)."""
        if num_slots != self.alloc.num_slots:
            self.clear()
            self.alloc = ExtentAllocator(num_slots)

    # ----------------------------------------------------------------- internals

    def _with_headroom(self, n: int) -> int:
        return n + max(self.min_headroom_blocks, int(n * self.headroom_fraction))

    def _grown(self, n: int) -> int:
        """Capacity for a session that outgrew its extent: geometric, so regrowth is amortised."""
        return n + max(self.min_headroom_blocks, int(n * self.regrow_fraction))

    def _truncate(self, entry: L1Entry, k: int) -> None:
        """Make only the first ``k`` blocks of ``entry`` readable (the rest will be overwritten)."""
        sid = entry.session_id
        for h in entry.hashes[k:]:
            holders = self._by_hash.get(h)
            if holders is not None and holders.get(sid) is entry:
                del holders[sid]
                if not holders:
                    del self._by_hash[h]
        entry.hashes = entry.hashes[:k]

    def _allocate(
        self, n: int, score: Callable[[SessionId], float] | None, exclude: SessionId | None,
        regrow: bool = False,
    ) -> tuple[int | None, int]:
        for capacity in (self._grown(n) if regrow else self._with_headroom(n), self._with_headroom(n), n):
            if capacity > self.alloc.num_slots:
                continue
            start = self.alloc.allocate(capacity)
            if start is not None:
                return start, capacity
        if n > self.alloc.num_slots:
            return None, 0
        self._make_room(n, score, exclude)
        start = self.alloc.allocate(n)
        return start, n

    def _make_room(
        self, num_slots: int, score: Callable[[SessionId], float] | None, exclude: SessionId | None
    ) -> int:
        if self.alloc.can_allocate(num_slots):
            return 0
        candidates = [
            e
            for e in self.entries.values()
            if e.num_holds == 0 and e.session_id not in self._pending and e.session_id != exclude
        ]
        value = score or (lambda sid: 0.0)
        candidates.sort(key=lambda e: (-value(e.session_id), e.last_used_s, e.start_slot))
        dropped = 0
        for entry in candidates:
            if self.alloc.can_allocate(num_slots):
                break
            self._unlink(entry)
            dropped += 1
        return dropped

    def _unlink(self, entry: L1Entry) -> None:
        assert entry.is_linked
        entry.is_linked = False
        if self.entries.get(entry.session_id) is entry:
            del self.entries[entry.session_id]
        for h in entry.hashes:
            holders = self._by_hash.get(h)
            if holders is not None and holders.get(entry.session_id) is entry:
                del holders[entry.session_id]
                if not holders:
                    del self._by_hash[h]
        if entry.num_holds:
            self._unlinked.append(entry)
        else:
            self.alloc.free(entry.start_slot, entry.capacity_blocks)

    def stats(self) -> L1Stats:
        return L1Stats(
            num_slots=self.alloc.num_slots,
            num_used_slots=self.alloc.num_used_slots,
            num_entries=len(self.entries),
            num_free_extents=self.alloc.num_free_extents,
            largest_free_extent=self.alloc.largest_free(),
            num_readable_blocks=sum(len(e.hashes) for e in self.entries.values()),
        )

    def check(self) -> None:
        self.alloc.check()
        used = sum(e.capacity_blocks for e in self.entries.values())
        used += sum(e.capacity_blocks for e in self._unlinked)
        used += sum(p.entry.capacity_blocks for p in self._pending.values() if p.first_block == 0)
        used += sum(p.entry.capacity_blocks for p in self._cancelled)
        assert used == self.alloc.num_used_slots, f"{used} slots accounted, {self.alloc.num_used_slots} used"
        for sid, entry in self.entries.items():
            assert entry.is_linked and entry.session_id == sid
            assert len(entry.hashes) <= entry.capacity_blocks
            for h in entry.hashes:
                assert self._by_hash[h][sid] is entry
        n_refs = sum(len(v) for v in self._by_hash.values())
        assert n_refs == sum(len(set(e.hashes)) for e in self.entries.values())
        for entry in self._unlinked:
            assert not entry.is_linked and entry.num_holds > 0
