"""Chain hashes: deterministic, prefix-sensitive, extendable, and layout-salted."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from cache.hashing import ChainHasher, chain_hashes, root_hash


def test_hashing_only_full_blocks_and_deterministic() -> None:
    h = ChainHasher(4)
    tokens = np.arange(11, dtype=np.int32)
    out = h.hashes(tokens)
    assert len(out) == 2
    assert out == ChainHasher(4).hashes(list(range(11)))  # lists and int64 arrays hash the same
    assert out == h.hashes(np.arange(11, dtype=np.int64))


def test_hashing_block_depends_on_every_earlier_token() -> None:
    h = ChainHasher(4)
    a = np.arange(12, dtype=np.int32)
    b = a.copy()
    b[1] = 99  # change block 0 only
    ha, hb = h.hashes(a), h.hashes(b)
    assert all(x != y for x, y in zip(ha, hb))  # every later block's name changes too
    c = a.copy()
    c[9] = 99  # change block 2 only
    hc = h.hashes(c)
    assert hc[:2] == ha[:2] and hc[2] != ha[2]


def test_hashing_salt_and_block_size_separate_chains() -> None:
    tokens = np.arange(64, dtype=np.int32)
    assert root_hash(16) != root_hash(32)
    assert ChainHasher(16, b"a").hashes(tokens) != ChainHasher(16, b"b").hashes(tokens)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 129_279), max_size=200), st.integers(0, 200))
def test_hashing_extend_equals_full(tokens: list[int], cut: int) -> None:
    h = ChainHasher(8)
    full = h.hashes(tokens)
    prefix = h.hashes(tokens[:cut])
    assert h.extend(prefix, tokens) == full
    assert chain_hashes(tokens, 8, full[-1] if full else h.root, len(full)) == []
