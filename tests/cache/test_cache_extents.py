"""Extent allocator: best fit, coalescing frees, in-place growth, no leaks (property test)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from cache.extents import ExtentAllocator


def test_extents_best_fit_and_coalesce() -> None:
    a = ExtentAllocator(100)
    x = a.allocate(10)
    y = a.allocate(20)
    z = a.allocate(30)
    assert (x, y, z) == (0, 10, 30)
    a.free(y, 20)
    a.free(60, 40) if False else None  # (kept simple: the tail 60..100 is already free)
    assert a.free_extents() == [(10, 20), (60, 40)]
    assert a.allocate(15) == 10  # best fit: the 20-hole, not the 40-hole
    a.free(10, 15)
    a.free(x, 10)
    a.free(z, 30)
    assert a.free_extents() == [(0, 100)]
    a.check()


def test_extents_try_extend_in_place() -> None:
    a = ExtentAllocator(50)
    s = a.allocate(10)
    assert a.try_extend(s, 10, 25)
    t = a.allocate(5)
    assert t == 25
    assert not a.try_extend(s, 25, 30)  # blocked by t
    assert a.num_used_slots == 30
    a.check()


def test_extents_rejects_double_free() -> None:
    a = ExtentAllocator(10)
    s = a.allocate(4)
    a.free(s, 4)
    with pytest.raises(ValueError):
        a.free(s, 4)
    assert a.allocate(11) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=60))
def test_extents_random_ops_never_leak(ops: list[tuple[bool, int]]) -> None:
    a = ExtentAllocator(200)
    live: list[tuple[int, int]] = []
    for is_alloc, n in ops:
        if is_alloc or not live:
            s = a.allocate(n)
            if s is not None:
                assert all(s + n <= t or t + m <= s for t, m in live)
                live.append((s, n))
        else:
            s, m = live.pop(n % len(live))
            a.free(s, m)
        a.check()
    for s, m in live:
        a.free(s, m)
    assert a.free_extents() == [(0, 200)]
