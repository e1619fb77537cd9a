"""A first-class extent allocator over ``num_slots`` host slots (one slot = one KV block row).

Used by the L1 index to give each session one contiguous run of slots, so restoring it is one
DMA from host to GPU plus a scatter into the block pool (per-block copies reach only a third of
the link: measured on the H200 host, ``docs/cache.md``).

Invariants (``check``): free extents are disjoint, sorted by start, never adjacent (freeing
coalesces with both neighbours), inside ``[0, num_slots)``; ``num_free_slots`` is their sum.
Allocation is best fit (the smallest free extent that holds the request, lowest start on ties),
which keeps big holes for big sessions.
"""

from __future__ import annotations

import bisect


class ExtentAllocator:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._starts: list[int] = [0] if num_slots else []  # free extents, sorted by start
        self._lengths: dict[int, int] = {0: num_slots} if num_slots else {}
        self.num_free_slots = num_slots

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - self.num_free_slots

    @property
    def num_free_extents(self) -> int:
        return len(self._starts)

    def largest_free(self) -> int:
        return max(self._lengths.values(), default=0)

    def can_allocate(self, num_slots: int) -> bool:
        return 0 < num_slots <= self.largest_free()

    def allocate(self, num_slots: int) -> int | None:
        """Start slot of a fresh extent of ``num_slots`` slots, or None if no hole is big enough."""
        if num_slots <= 0:
            raise ValueError(f"extent length must be positive, got {num_slots}")
        best_start = -1
        best_len = 0
        for start in self._starts:
            length = self._lengths[start]
            if length >= num_slots and (best_start < 0 or length < best_len):
                best_start, best_len = start, length
                if length == num_slots:
                    break
        if best_start < 0:
            return None
        self._take(best_start, num_slots)
        return best_start

    def try_extend(self, start: int, length: int, new_length: int) -> bool:
        """Grow the extent ``[start, start+length)`` in place to ``new_length`` if the slots just
        after it are free. Returns False (nothing changed) otherwise."""
        if new_length <= length:
            return True
        end = start + length
        free_len = self._lengths.get(end)
        if free_len is None or free_len < new_length - length:
            return False
        self._take(end, new_length - length)
        return True

    def free(self, start: int, length: int) -> None:
        """Return ``[start, start+length)`` (it must be allocated) and merge it with neighbours."""
        if length <= 0 or start < 0 or start + length > self.num_slots:
            raise ValueError(f"bad extent [{start}, {start + length}) of {self.num_slots} slots")
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] < start + length:
            raise ValueError(f"extent [{start}, {start + length}) overlaps a free extent")
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] > start:
            raise ValueError(f"extent [{start}, {start + length}) overlaps a free extent")
        new_start, new_len = start, length
        if i < len(self._starts) and self._starts[i] == start + length:  # merge right
            new_len += self._lengths.pop(self._starts[i])
            del self._starts[i]
        if i > 0:
            left = self._starts[i - 1]
            if left + self._lengths[left] == start:  # merge left
                new_start = left
                new_len += self._lengths.pop(left)
                del self._starts[i - 1]
                i -= 1
        self._starts.insert(i, new_start)
        self._lengths[new_start] = new_len
        self.num_free_slots += length

    def _take(self, free_start: int, num_slots: int) -> None:
        """Carve ``num_slots`` off the front of the free extent starting at ``free_start``."""
        length = self._lengths.pop(free_start)
        i = bisect.bisect_left(self._starts, free_start)
        assert self._starts[i] == free_start and length >= num_slots
        if length == num_slots:
            del self._starts[i]
        else:
            self._starts[i] = free_start + num_slots
            self._lengths[free_start + num_slots] = length - num_slots
        self.num_free_slots -= num_slots

    def free_extents(self) -> list[tuple[int, int]]:
        return [(s, self._lengths[s]) for s in self._starts]

    def check(self) -> None:
        prev_end = -1
        total = 0
        assert sorted(self._starts) == self._starts and set(self._starts) == set(self._lengths)
        for start in self._starts:
            length = self._lengths[start]
            assert length > 0 and start >= 0 and start + length <= self.num_slots
            assert start > prev_end, "free extents adjacent or overlapping (not coalesced)"
            prev_end = start + length
            total += length
        assert total == self.num_free_slots
