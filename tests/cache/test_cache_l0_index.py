"""L0 index: longest-prefix match, duplicates, use counts and leaf-first, value-ordered eviction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cache.hashing import ChainHasher
from cache.l0_index import L0Index, RankIndex
from cache.sessions import SessionId

BS = 4
H = ChainHasher(BS)
A, B = SessionId("a"), SessionId("b")


def chain(*values: int) -> list:
    """Hashes of one block per value (block i = [v_i]*BS)."""
    return H.hashes(np.repeat(np.array(values, dtype=np.int32), BS))


def no_protect(owner: object) -> bool:
    return True


def test_l0_match_is_longest_present_prefix() -> None:
    idx = RankIndex(0)
    c = chain(1, 2, 3, 4)
    assert idx.insert(c[:3], [10, 11, 12], A, 0.0) == []
    assert idx.match(c) == 3
    assert idx.match(chain(1, 2, 9)) == 2
    assert idx.match(chain(5)) == 0
    assert idx.block_ids(c[:3]) == [10, 11, 12]
    idx.check()


def test_l0_insert_returns_duplicates_for_filed_hashes() -> None:
    idx = RankIndex(0)
    c = chain(1, 2, 3)
    idx.insert(c[:2], [10, 11], A, 0.0)
    # a finished request hands blocks 10 (its prefix block, same id), 20 (replayed copy) and 21
    assert idx.insert(c, [10, 20, 21], A, 1.0) == [10, 20]
    assert idx.block_ids(c) == [10, 11, 21]
    idx.check()
    with pytest.raises(ValueError):
        idx.insert(c, [1], A, 1.0)


def test_l0_in_use_blocks_are_never_evicted() -> None:
    idx = RankIndex(0)
    c = chain(1, 2, 3)
    idx.insert(c, [10, 11, 12], A, 0.0)
    idx.acquire(c[:2], A, 1.0)
    victims = idx.evict(10, lambda o: 1.0, no_protect)
    assert [v.block_id for v in victims] == [12]  # the leaf only; 10 and 11 are in use
    idx.release_uses(c[:2])
    assert [v.block_id for v in idx.evict(10, lambda o: 1.0, no_protect)] == [11, 10]
    assert len(idx) == 0
    idx.check()


def test_l0_eviction_order_value_then_leaf_up() -> None:
    """Owner score first (higher = less likely back soon), each session's tail from its leaf
    up, never a parent before its children, shared prefixes last."""
    idx = RankIndex(0)
    shared = chain(7, 8)
    a = chain(7, 8, 1, 2)
    b = chain(7, 8, 3, 4, 5)
    idx.insert(shared, [1, 2], None, 0.0)
    idx.insert(a, [1, 2, 10, 11], A, 5.0)  # A touches the shared blocks last -> owner A
    idx.insert(b, [1, 2, 20, 21, 22], B, 3.0)
    idx.check()
    scores = {A: 10.0, B: 100.0}  # B is expected back much later: evict B first
    victims = idx.evict(100, lambda o: scores[o], no_protect)
    order = [v.block_id for v in victims]
    assert order == [22, 21, 20, 11, 10, 2, 1]
    idx.check()


def test_l0_eviction_skips_protected_owners() -> None:
    idx = RankIndex(0)
    idx.insert(chain(1, 2), [10, 11], A, 0.0)
    idx.insert(chain(3, 4), [20, 21], B, 0.0)
    victims = idx.evict(5, lambda o: 0.0, lambda o: o == B)
    assert sorted(v.block_id for v in victims) == [20, 21]
    assert idx.num_evictable(lambda o: o == B) == 0
    assert idx.num_evictable(no_protect) == 2
    idx.check()


def test_l0_eviction_partial_takes_only_what_is_asked() -> None:
    idx = RankIndex(0)
    idx.insert(chain(1, 2, 3, 4), [10, 11, 12, 13], A, 0.0)
    assert [v.block_id for v in idx.evict(2, lambda o: math.inf, no_protect)] == [13, 12]
    assert idx.match(chain(1, 2, 3, 4)) == 2
    idx.check()


def test_l0_owner_moves_leaf_sets() -> None:
    idx = RankIndex(0)
    c = chain(1, 2)
    idx.insert(c, [10, 11], A, 0.0)
    idx.acquire(c, B, 1.0)
    idx.release_uses(c)
    assert idx.owners() == {B}  # only the deepest block changes hands (O(1) per turn)
    assert idx.num_blocks_owned(B) == 1 and idx.num_blocks_owned(A) == 0
    idx.check()


def test_l0_best_rank_and_remove_all() -> None:
    l0 = L0Index(3)
    c = chain(1, 2, 3)
    l0[1].insert(c[:1], [5], A, 0.0)
    l0[2].insert(c, [5, 6, 7], A, 0.0)
    assert l0.match_all(c) == [0, 1, 3]
    assert l0.best_rank(c) == (2, 3)
    assert len(l0[2].remove_all()) == 3 and l0.num_blocks() == 1
