"""Ref-counted KV block pool of the scripted stand-in model, storing token ids as its "KV".

The scripted engine has no KV tensors; instead each block records the token ids whose KV it would
hold. That keeps the block contract of ``rank/engine.py`` exact (same ids, same counts, same
kept-block lists as a real engine) and lets the engine check that a prefix handed over by the
cache layer really holds the prompt's tokens, including after a round trip through the L1 host
pool (``rank.host_pool.HostPool``: a slot holds one block's int32 ids as ``block_size * 4`` bytes;
``export_blocks`` writes them, ``import_blocks`` reads them back, on any rank of the group).

Ids and reference counts are the reference engine's ``rank.block_manager.BlockManager`` (same
invariants: block 0 scratch, count == cache refs + live block-table occurrences, free exactly at
count 0); this module adds the per-block token ids and the host-slot copies.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from rank.block_manager import BlockManager
from rank.engine import CapacityExhausted, EngineMisuse, checked_host_pool

if TYPE_CHECKING:
    from rank.host_pool import HostPool

_UNWRITTEN = -1


class BlockPool:
    """The reference engine's ``BlockManager`` (ids and ref counts) plus each block's token ids."""

    def __init__(self, num_blocks: int, block_size: int, host_pool: HostPool | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._bm = BlockManager(num_blocks)
        self._tokens = np.full((num_blocks, block_size), _UNWRITTEN, dtype=np.int32)
        # The same memory as uint8 rows: what the L1 host pool copies (one slot = one block row).
        self._rows = torch.from_numpy(self._tokens).view(torch.uint8)
        self.host_pool = host_pool
        if host_pool is not None:
            host_pool.open(block_size * 4)

    @property
    def num_free(self) -> int:
        return self._bm.num_free_blocks

    @property
    def num_cache_held(self) -> int:
        return self._bm.num_cached_blocks

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
        self._bm.validate_held(prefix, what="prefix_blocks", need_cache_ref=False)

    def first_mismatch(self, prefix: list[int], prompt: np.ndarray) -> tuple[int, int] | None:
        """(block, position) of the first prefix token that differs from the prompt, or None."""
        for i, block in enumerate(prefix):
            stored = self._tokens[block]
            expect = np.asarray(prompt[i * self.block_size : (i + 1) * self.block_size], dtype=np.int32)
            diff = np.nonzero(stored != expect)[0]
            if len(diff):
                return block, i * self.block_size + int(diff[0])
        return None

    def take_seq_refs(self, blocks: list[int]) -> None:
        self._bm.incref(blocks)

    def can_allocate(self, num: int) -> bool:
        return self._bm.can_allocate(num)

    def allocate_seq(self, num: int) -> list[int]:
        """``num`` fresh blocks with one sequence ref each (call ``can_allocate`` first)."""
        blocks = self._bm.allocate(num)
        self._tokens[blocks] = _UNWRITTEN
        return blocks

    def write_tokens(self, table: list[int], start: int, tokens: np.ndarray) -> None:
        """Store ``tokens`` at positions ``start..`` of a sequence (its own blocks only)."""
        pos = start
        while pos < start + len(tokens):
            block = table[pos // self.block_size]
            offset = pos % self.block_size
            n = min(self.block_size - offset, start + len(tokens) - pos)
            assert self._bm.cache_refs[block] == 0, f"write into cache-held block {block}"
            self._tokens[block, offset : offset + n] = tokens[pos - start : pos - start + n]
            pos += n

    def convert_to_cache(self, blocks: list[int]) -> list[int]:
        """A finishing sequence's refs on ``blocks`` become cache refs (counts unchanged)."""
        self._bm.to_cache(blocks)
        return list(blocks)

    def drop_seq_refs(self, blocks: list[int]) -> None:
        self._bm.decref(blocks)

    # ---- cache-facing ------------------------------------------------------------------------

    def release(self, blocks: list[int]) -> None:
        """Drop one cache ref per listed block; all validated before any changes."""
        self._bm.validate_held(blocks, what="release", need_cache_ref=True)
        self._bm.decref(blocks, cache_ref=True)

    def export_blocks(self, blocks: list[int], host_slot: int) -> None:
        pool = checked_host_pool(self.host_pool, host_slot, len(blocks))
        self._bm.validate_held(blocks, what="export_blocks", need_cache_ref=False)
        pool.copy_from_device(self._rows, blocks, host_slot)

    def import_blocks(self, host_slot: int, num: int) -> list[int]:
        pool = checked_host_pool(self.host_pool, host_slot, num)
        if not self._bm.can_allocate(num):
            raise CapacityExhausted(f"import needs {num} blocks, {self._bm.num_free_blocks} free")
        blocks = self._bm.allocate(num, cache_ref=True)
        pool.copy_to_device(self._rows, blocks, host_slot)
        return blocks


    def close(self) -> None:
        if self.host_pool is not None:
            self.host_pool.close()

    # ---- checks --------------------------------------------------------------------------------

    def check(self, tables: Iterable[list[int]]) -> None:
        seq_refs: Counter[int] = Counter()
        for table in tables:
            seq_refs.update(table)
        self._bm.check(dict(seq_refs))
