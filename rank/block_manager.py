"""Reference-counted KV block pool bookkeeping (ids only; the bytes live in the engine's pool).

Thread safety: every public method is one critical section under ``lock``, so a rank's transfer
thread (``rank/transfers.py``) may import and export while the loop thread steps. Decisions
that read then change (is there room? then take it) are one call (``try_allocate``,
``pin_held``), never two, so no other thread can slip in between.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence

from rank.engine import CapacityExhausted, EngineMisuse


class BlockManager:
    """Hands out block ids ``1 .. num_blocks-1`` with reference counts.

    Invariants:
    * block 0 is scratch: never in the free list, never handed out, count always 0;
    * a block is in the free list exactly when its count is 0 (and it is not block 0);
    * ``cache_refs[b] <= ref_counts[b]``: the cache's share of a block's references (the rest
      belong to live sequences, which the engine checks in ``check_accounting``, and to exports
      in progress: ``pinned[b]``, one ref per export copying the block).
    Freed blocks go to the *front* of the free list in reverse order, so a chain's tail is
    reused first and a recently used prefix survives longest in the bytes (nothing relies on it).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is scratch), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.cache_refs = [0] * num_blocks
        self.pinned = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self.lock = threading.Lock()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return sum(1 for n in self.cache_refs if n)

    def can_allocate(self, num_blocks: int) -> bool:
        """A hint only when another thread allocates too: use ``try_allocate`` to act on it."""
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int, *, cache_ref: bool = False) -> list[int]:
        """Take ``num_blocks`` free blocks with one ref each (a cache ref if ``cache_ref``)."""
        ids = self.try_allocate(num_blocks, cache_ref=cache_ref)
        if ids is None:
            raise CapacityExhausted(f"need {num_blocks} KV blocks, {len(self._free)} free")
        return ids

    def try_allocate(self, num_blocks: int, *, cache_ref: bool = False) -> list[int] | None:
        """``allocate``, or None (nothing changed) when fewer than ``num_blocks`` are free."""
        with self.lock:
            if num_blocks > len(self._free):
                return None
            ids = [self._free.popleft() for _ in range(num_blocks)]
            for block_id in ids:
                self.ref_counts[block_id] = 1
                if cache_ref:
                    self.cache_refs[block_id] = 1
            return ids

    def validate_held(self, block_ids: Sequence[int], *, what: str, need_cache_ref: bool) -> None:
        """Raise EngineMisuse unless every id is a valid, distinct, allocated (cache-held) block."""
        with self.lock:
            self._validate_held(block_ids, what, need_cache_ref)

    def pin_held(self, block_ids: Sequence[int], *, what: str) -> None:
        """Validate like ``validate_held`` (any holder) and take one pin ref on each block, in one
        critical section: a release that lands while the blocks are copied cannot free them."""
        with self.lock:
            self._validate_held(block_ids, what, False)
            for block_id in block_ids:
                self.ref_counts[block_id] += 1
                self.pinned[block_id] += 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Drop the refs ``pin_held`` took; blocks reaching 0 return to the free list."""
        with self.lock:
            for block_id in block_ids:
                assert self.pinned[block_id] > 0, f"unpin of unpinned block {block_id}"
                self.pinned[block_id] -= 1
            self._decref(block_ids, cache_ref=False)

    def _validate_held(self, block_ids: Sequence[int], what: str, need_cache_ref: bool) -> None:
        seen: set[int] = set()
        for block_id in block_ids:
            if not isinstance(block_id, int) or isinstance(block_id, bool):
                raise EngineMisuse(f"{what}: block id {block_id!r} is not an int")
            if not 1 <= block_id < self.num_blocks:
                raise EngineMisuse(f"{what}: block id {block_id} outside 1..{self.num_blocks - 1}")
            if block_id in seen:
                raise EngineMisuse(f"{what}: block id {block_id} given twice")
            seen.add(block_id)
            if self.ref_counts[block_id] <= 0:
                raise EngineMisuse(f"{what}: block {block_id} is free")
            if need_cache_ref and self.cache_refs[block_id] <= 0:
                raise EngineMisuse(f"{what}: block {block_id} holds no cache reference")

    def release_held(self, block_ids: Sequence[int], *, what: str) -> None:
        """Validate like ``validate_held`` (cache refs needed) and drop one cache ref on each block,
        in one critical section: a release on the transfer thread and one on the loop thread (or
        a step's allocation) cannot interleave between the check and the change."""
        with self.lock:
            self._validate_held(block_ids, what, True)
            self._decref(block_ids, cache_ref=True)

    def incref(self, block_ids: Iterable[int]) -> None:
        with self.lock:
            for block_id in block_ids:
                assert self.ref_counts[block_id] > 0, f"incref of free block {block_id}"
                self.ref_counts[block_id] += 1

    def to_cache(self, block_ids: Iterable[int]) -> None:
        """Turn one sequence ref on each block into a cache ref (count unchanged)."""
        with self.lock:
            for block_id in block_ids:
                self.cache_refs[block_id] += 1
                assert self.cache_refs[block_id] <= self.ref_counts[block_id]

    def decref(self, block_ids: Sequence[int], *, cache_ref: bool = False) -> None:
        """Drop one ref on each block; blocks reaching 0 return to the free list."""
        with self.lock:
            self._decref(block_ids, cache_ref=cache_ref)

    def _decref(self, block_ids: Sequence[int], *, cache_ref: bool) -> None:
        for block_id in reversed(block_ids):
            assert block_id != 0 and self.ref_counts[block_id] > 0, f"double free of {block_id}"
            if cache_ref:
                assert self.cache_refs[block_id] > 0, f"cache ref underflow on {block_id}"
                self.cache_refs[block_id] -= 1
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free.appendleft(block_id)

    def check(self, seq_refs: dict[int, int]) -> None:
        """Assert the full bookkeeping, given how many refs live sequences hold per block."""
        with self.lock:
            self._check(seq_refs)

    def _check(self, seq_refs: dict[int, int]) -> None:
        assert self.ref_counts[0] == 0 and self.cache_refs[0] == 0, "scratch block 0 is referenced"
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is in the free list twice"
        assert 0 not in free, "scratch block 0 is in the free list"
        free_set = set(free)
        for block_id in range(1, self.num_blocks):
            count = self.ref_counts[block_id]
            expected = self.cache_refs[block_id] + seq_refs.get(block_id, 0) + self.pinned[block_id]
            assert count == expected, (
                f"block {block_id}: count {count} != cache {self.cache_refs[block_id]} + "
                f"sequences {seq_refs.get(block_id, 0)} + exports {self.pinned[block_id]}"
            )
            assert (count == 0) == (block_id in free_set), f"block {block_id}: free list mismatch"
        assert len(free) + sum(1 for n in self.ref_counts if n) == self.num_blocks - 1
