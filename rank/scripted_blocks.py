"""Ref-counted KV block pool of the scripted stand-in model, storing token ids as its "KV".

The scripted engine has no KV tensors; instead each block records the token ids whose KV it would
hold. That keeps the block contract of ``rank/engine.py`` exact (same ids, same counts, same
kept-block lists as a real engine) and lets the engine check that a prefix handed over by the
cache layer really holds the prompt's tokens, including after a round trip through the L1 host
pool (``export_blocks`` writes the ids into the host slots, ``import_blocks`` reads them back).

Invariants (``check``):
* block 0 is scratch: never free, never allocated, count 0;
* ``refs[b] == cache_refs[b] + (occurrences of b in live block tables)`` for every block;
* ``b`` is on the free list (once) exactly when ``refs[b] == 0``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from rank.engine import CapacityExhausted, EngineMisuse

_UNWRITTEN = -1
_UNKNOWN = -2  # imported from a host slot this engine cannot read: content not checked


class BlockPool:
    """Block ids ``1 .. num_blocks-1`` with sequence and cache references and their token ids."""

    def __init__(self, num_blocks: int, block_size: int, host_pool: Any = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = np.zeros(num_blocks, dtype=np.int64)
        self._cache_refs = np.zeros(num_blocks, dtype=np.int64)
        self._free: deque[int] = deque(range(1, num_blocks))
        self._tokens = np.full((num_blocks, block_size), _UNWRITTEN, dtype=np.int32)
        self._host = _HostStore(host_pool, block_size)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cache_held(self) -> int:
        return int(np.count_nonzero(self._cache_refs))

    # ---- sequences ----------------------------------------------------------------------------

    def validate_prefix(self, prefix: list[int], num_cached_tokens: int, prompt_len: int) -> None:
        """The ``add`` contract on prefix blocks; raises EngineMisuse, changes nothing."""
        if num_cached_tokens != self.block_size * len(prefix):
            raise EngineMisuse(
                f"num_cached_tokens {num_cached_tokens} != block_size {self.block_size} x "
                f"{len(prefix)} prefix blocks"
            )
        if prefix and num_cached_tokens > prompt_len - 1:
            raise EngineMisuse(
                f"num_cached_tokens {num_cached_tokens} must leave one of {prompt_len} prompt tokens"
            )
        if len(set(prefix)) != len(prefix):
            raise EngineMisuse(f"duplicate prefix block ids {prefix}")
        for block in prefix:
            self._check_range(block)
            if self._refs[block] <= 0:
                raise EngineMisuse(f"prefix block {block} is free (ref count 0)")

    def first_mismatch(self, prefix: list[int], prompt: np.ndarray) -> tuple[int, int] | None:
        """(block, position) of the first prefix token that differs from the prompt, or None."""
        for i, block in enumerate(prefix):
            stored = self._tokens[block]
            if stored[0] == _UNKNOWN:
                continue
            expect = np.asarray(prompt[i * self.block_size : (i + 1) * self.block_size], dtype=np.int32)
            diff = np.nonzero(stored != expect)[0]
            if len(diff):
                return block, i * self.block_size + int(diff[0])
        return None

    def take_seq_refs(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self._refs[block] += 1

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate_seq(self, num: int) -> list[int]:
        """``num`` fresh blocks with one sequence ref each (call ``can_allocate`` first)."""
        assert num <= len(self._free), "allocate_seq without can_allocate"
        blocks = [self._free.popleft() for _ in range(num)]
        for block in blocks:
            self._refs[block] = 1
            self._tokens[block] = _UNWRITTEN
        return blocks

    def write_tokens(self, table: list[int], start: int, tokens: np.ndarray) -> None:
        """Store ``tokens`` at positions ``start..`` of a sequence (its own blocks only)."""
        pos = start
        while pos < start + len(tokens):
            block = table[pos // self.block_size]
            offset = pos % self.block_size
            n = min(self.block_size - offset, start + len(tokens) - pos)
            assert self._cache_refs[block] == 0, f"write into cache-held block {block}"
            self._tokens[block, offset : offset + n] = tokens[pos - start : pos - start + n]
            pos += n

    def convert_to_cache(self, blocks: list[int]) -> list[int]:
        """A finishing sequence's refs on ``blocks`` become cache refs (counts unchanged)."""
        for block in blocks:
            self._cache_refs[block] += 1
        return list(blocks)

    def drop_seq_refs(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self._unref(block)

    # ---- cache-facing ------------------------------------------------------------------------

    def release(self, blocks: list[int]) -> None:
        """Drop one cache ref per listed block; all validated before any changes."""
        for block, times in Counter(blocks).items():
            self._check_range(block)
            if self._cache_refs[block] < times:
                raise EngineMisuse(
                    f"release of block {block} x{times}, but it holds {int(self._cache_refs[block])} cache refs"
                )
        for block in blocks:
            self._cache_refs[block] -= 1
            self._unref(block)

    def export_blocks(self, blocks: list[int], host_slot: int) -> None:
        for block in blocks:
            self._check_range(block)
            if self._refs[block] <= 0:
                raise EngineMisuse(f"export of free block {block}")
        self._host.check_slots(host_slot, len(blocks))
        for i, block in enumerate(blocks):
            self._host.write(host_slot + i, self._tokens[block])

    def import_blocks(self, host_slot: int, num: int) -> list[int]:
        if num < 0:
            raise EngineMisuse(f"import of {num} blocks")
        self._host.check_slots(host_slot, num)
        if num > len(self._free):
            raise CapacityExhausted(f"import needs {num} blocks, {len(self._free)} free")
        blocks = self.allocate_seq(num)
        for i, block in enumerate(blocks):
            self._tokens[block] = self._host.read(host_slot + i)
        return self.convert_to_cache(blocks)

    # ---- checks --------------------------------------------------------------------------------

    def check(self, tables: Iterable[list[int]]) -> None:
        seq_refs = np.zeros(self.num_blocks, dtype=np.int64)
        for table in tables:
            for block in table:
                seq_refs[block] += 1
        assert self._refs[0] == 0 and self._cache_refs[0] == 0 and seq_refs[0] == 0, "block 0 in use"
        bad = np.nonzero(self._refs != seq_refs + self._cache_refs)[0]
        assert len(bad) == 0, f"ref counts off for blocks {bad[:10].tolist()}"
        assert (self._refs >= 0).all() and (self._cache_refs >= 0).all(), "negative ref count"
        free = list(self._free)
        assert len(free) == len(set(free)), "block twice on the free list"
        assert 0 not in free, "block 0 on the free list"
        zero = set(np.nonzero(self._refs[1:] == 0)[0] + 1)
        assert set(free) == zero, f"free list != zero-count blocks ({len(free)} vs {len(zero)})"

    def _check_range(self, block: int) -> None:
        if not 1 <= block < self.num_blocks:
            raise EngineMisuse(f"block id {block} out of range 1..{self.num_blocks - 1}")

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        assert self._refs[block] >= self._cache_refs[block], f"block {block} lost a ref"
        if self._refs[block] == 0:
            self._free.append(block)


class _HostStore:
    """Where exported token ids go: the shared L1 host pool if given, else a private dict.

    In the shared pool, a slot's first ``block_size * 4`` bytes hold the block's int32 ids.
    """

    def __init__(self, host_pool: Any, block_size: int) -> None:
        self._pool = host_pool
        self._block_size = block_size
        self._local: dict[int, np.ndarray] = {}

    def check_slots(self, first: int, num: int) -> None:
        if first < 0:
            raise EngineMisuse(f"host slot {first} < 0")
        limit = getattr(self._pool, "num_slots", None)
        if limit is not None and first + num > limit:
            raise EngineMisuse(f"host slots {first}..{first + num - 1} beyond the pool's {limit}")

    def write(self, slot: int, tokens: np.ndarray) -> None:
        if self._pool is None:
            self._local[slot] = tokens.copy()
            return
        view = _slot_bytes(self._pool, slot)
        view[: tokens.nbytes] = np.frombuffer(tokens.tobytes(), dtype=np.uint8)

    def read(self, slot: int) -> np.ndarray:
        if self._pool is None:
            found = self._local.get(slot)
            return found.copy() if found is not None else np.full(self._block_size, _UNKNOWN, np.int32)
        view = _slot_bytes(self._pool, slot)
        return np.frombuffer(bytes(view[: self._block_size * 4]), dtype=np.int32).copy()


def _slot_bytes(host_pool: Any, slot: int) -> np.ndarray:
    """A writable uint8 numpy view of one host slot (pool API adapted in one place)."""
    view = host_pool.slot(slot)
    return view.numpy() if hasattr(view, "numpy") else np.asarray(view)
