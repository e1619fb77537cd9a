"""L1 index: contiguous session extents, append in place, relocation, holds, eviction by value."""

from __future__ import annotations

import numpy as np

from cache.hashing import ChainHasher
from cache.l1_index import L1Index
from cache.sessions import SessionId

H = ChainHasher(4)
A, B, C = SessionId("a"), SessionId("b"), SessionId("c")


def chain(n: int, base: int = 0) -> list:
    return H.hashes(np.arange(base, base + 4 * n, dtype=np.int32))


def test_l1_write_commit_match() -> None:
    l1 = L1Index(100, headroom_fraction=0.0, min_headroom_blocks=4)
    c = chain(6)
    plan = l1.plan_write(A, c, 0.0)
    assert plan is not None and plan.first_block == 0 and plan.num_blocks == 6
    assert l1.match(c) == (None, 0)  # not readable before the copy completed
    l1.commit(plan, 1.0)
    entry, n = l1.match(c + chain(2, 1000))
    assert entry is not None and n == 6 and entry.start_slot == plan.host_slot
    assert l1.plan_write(A, c, 2.0) is None  # already held
    l1.check()


def test_l1_append_in_place_then_relocate() -> None:
    l1 = L1Index(40, headroom_fraction=0.0, min_headroom_blocks=2)
    c = chain(12)
    p = l1.plan_write(A, c[:4], 0.0)
    l1.commit(p, 0.0)  # extent of 6 slots at 0
    p2 = l1.plan_write(A, c[:6], 1.0)
    assert p2 is not None and p2.first_block == 4 and p2.host_slot == 4  # headroom used
    l1.commit(p2, 1.0)
    blocker = l1.plan_write(B, chain(3, 500), 1.0)  # lands right after A's extent
    l1.commit(blocker, 1.0)
    p3 = l1.plan_write(A, c[:10], 2.0)  # cannot grow: relocated, whole chain rewritten
    assert p3 is not None and p3.first_block == 0 and p3.host_slot != 0
    assert l1.match(c)[1] == 6  # the old copy stays readable until the new one is complete
    l1.commit(p3, 2.0)
    assert l1.match(c)[1] == 10 and l1.entries[A].start_slot == p3.host_slot
    l1.check()


def test_l1_drop_while_read_frees_after_last_reader() -> None:
    l1 = L1Index(20, headroom_fraction=0.0, min_headroom_blocks=0)
    p = l1.plan_write(A, chain(5), 0.0)
    l1.commit(p, 0.0)
    entry, _ = l1.match(chain(5))
    l1.begin_read(entry)
    assert l1.drop(A)
    assert l1.alloc.num_used_slots == 5  # still being read
    assert l1.match(chain(5)) == (None, 0)
    l1.end_read(entry)
    assert l1.alloc.num_used_slots == 0
    l1.check()


def test_l1_drop_during_write_cancels_it() -> None:
    l1 = L1Index(20, headroom_fraction=0.0, min_headroom_blocks=0)
    p = l1.plan_write(A, chain(5), 0.0)
    assert l1.drop(A)
    l1.check()
    l1.commit(p, 1.0)  # acts as abort: slots freed, nothing readable
    assert l1.match(chain(5)) == (None, 0) and l1.alloc.num_used_slots == 0
    l1.check()


def test_l1_full_pool_evicts_least_valuable_entry() -> None:
    l1 = L1Index(10, headroom_fraction=0.0, min_headroom_blocks=0)
    for sid, base in ((A, 0), (B, 100)):
        l1.commit(l1.plan_write(sid, chain(5, base), 0.0), 0.0)
    value = {A: 5.0, B: 500.0}  # B is expected back much later
    p = l1.plan_write(C, chain(4, 300), 1.0, score=lambda s: value[s])
    assert p is not None
    assert set(l1.entries) == {A}
    l1.commit(p, 1.0)
    assert set(l1.entries) == {A, C}
    l1.check()


def test_l1_clear_voids_old_plans() -> None:
    l1 = L1Index(10, headroom_fraction=0.0, min_headroom_blocks=0)
    p = l1.plan_write(A, chain(3), 0.0)
    l1.clear()
    l1.commit(p, 0.0)
    assert not l1.entries and l1.alloc.num_used_slots == 0
    l1.check()
