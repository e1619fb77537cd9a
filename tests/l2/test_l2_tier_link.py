"""``cache/kv_tier.py``'s TierLink between the L1 index and an L2 store (inline I/O, so every
outcome is a function of the calls, not of timing), and the L1 index kept across a restart."""

from __future__ import annotations

import asyncio
import os

import numpy as np

from cache.kv_tier import TierLink
from cache.l1_index import L1Index
from cache.l2_scan import read_header
from cache.sessions import SessionId
from tests.l2.l2_helpers import HASHER, ODD_BPB, STAMP, chain, files, fill, make_store, run

A, B = SessionId("a"), SessionId("b")


def _link(tmp_path, num_slots: int = 64) -> tuple[TierLink, L1Index]:
    store = make_store(str(tmp_path), num_slots=num_slots, io_threads=0)
    l1 = L1Index(num_slots, headroom_fraction=0.0, min_headroom_blocks=0)
    return TierLink(l1, store, HASHER.root), l1


def _write_l1(link: TierLink, sid: SessionId, hashes: list, seed: int, now: float = 0.0) -> np.ndarray:
    """What a rank export does: plan, copy bytes into the plan's slots, commit."""
    plan = link.l1.plan_write(sid, hashes, now)
    assert plan is not None
    data = fill(link.tier.host, plan.host_slot, plan.num_blocks, seed)
    link.l1.commit(plan, now)
    return data


def test_spill_then_fill_round_trips_a_session_through_disk(tmp_path) -> None:
    link, l1 = _link(tmp_path)
    c = chain(20)
    data = _write_l1(link, A, c, seed=1)
    assert run(link.spill(A)) == 20 and link.match(c) == 20
    assert run(link.spill(A)) == 0  # nothing new
    assert l1.entries[A].num_holds == 0
    # L1 loses it (evicted for another session), then a turn needs it back: disk -> host slots.
    l1.drop(A)
    link.tier.host.array[:] = 0
    got = run(link.fill(B, c, 15, 1.0))
    assert got.entry is not None and got.num_blocks == 15 and (got.first_loaded, got.num_loaded) == (0, 15)
    assert got.loaded_within(5, 10) == 10 and got.loaded_within(14, 5) == 1
    start = got.entry.start_slot
    assert np.array_equal(link.tier.host.array[start : start + 15], data[:15])
    assert l1.match(c) == (got.entry, 15)
    # Already held: nothing loaded.
    again = run(link.fill(B, c, 12, 2.0))
    assert again.entry is got.entry and again.num_blocks == 12 and again.num_loaded == 0
    l1.check()


def test_fill_appends_to_the_sessions_entry_and_counts_only_loaded_blocks(tmp_path) -> None:
    link, l1 = _link(tmp_path)
    c = chain(30)
    data = _write_l1(link, A, c, seed=2)
    run(link.spill(A))
    l1.drop(A)
    _write_l1(link, A, c[:10], seed=3)  # the session's L1 copy holds a shorter prefix
    got = run(link.fill(A, c, 30, 1.0))
    assert (got.num_blocks, got.first_loaded, got.num_loaded) == (30, 10, 20)
    start = got.entry.start_slot
    assert np.array_equal(link.tier.host.array[start + 10 : start + 30], data[10:30])
    l1.check()


def test_a_corrupt_extent_fills_the_verified_prefix_only(tmp_path) -> None:
    link, l1 = _link(tmp_path)
    c = chain(20)
    _write_l1(link, A, c, seed=4)
    run(link.spill(A))
    (name,) = files(str(tmp_path))
    path = os.path.join(str(tmp_path), name)
    header, _, _ = read_header(path, STAMP)
    with open(path, "r+b") as f:  # flip one byte of block 12
        f.seek(header.payload_offset + 12 * ODD_BPB + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    l1.drop(A)
    got = run(link.fill(B, c, 20, 1.0))
    assert got.num_blocks == 12 and got.num_loaded == 12 and link.counters.short_fills == 1
    assert l1.match(c)[1] == 12 and link.match(c) == 0  # the bad extent is gone from L2
    l1.check()


def test_a_spill_asked_for_while_one_runs_runs_after_it(tmp_path) -> None:
    link, l1 = _link(tmp_path)
    c = chain(24)
    _write_l1(link, A, c[:8], seed=5)

    async def scenario() -> tuple[int, int]:
        first = asyncio.ensure_future(link.spill(A))
        await asyncio.sleep(0)  # the first spill is saving blocks 0..7
        _write_l1(link, A, c, seed=6)  # the session grew meanwhile (appended in place)
        second = await link.spill(A)  # coalesced into the running one
        return second, await first

    assert run(scenario()) == (0, 24) and link.match(c) == 24
    assert len(files(str(tmp_path))) == 2  # blocks 0..7, then 8..23
    assert not link.is_spilling() and l1.entries[A].num_holds == 0
    l1.check()


def test_l1_entries_survive_a_restart_but_writes_and_reads_in_flight_are_void(tmp_path) -> None:
    l1 = L1Index(64, headroom_fraction=0.0, min_headroom_blocks=2)
    ca, cb, cc = chain(10, base=0), chain(6, base=5000), chain(8, base=9000)
    for sid, c in ((A, ca), (B, cb)):
        plan = l1.plan_write(sid, c, 0.0)
        l1.commit(plan, 0.0)
    reading = l1.entries[A]
    l1.begin_read(reading)  # an import of A in flight
    appending = l1.plan_write(B, cb + chain(9, base=5000)[6:], 1.0)  # an in-place append of B in flight
    assert appending is not None and appending.first_block == 6
    new = l1.plan_write(SessionId("c"), cc, 1.0)  # a new extent being written
    used_before = l1.alloc.num_used_slots
    assert l1.keep_across_restart() == 2
    assert l1.match(ca)[1] == 10 and l1.match(cb)[1] == 6 and l1.match(cc)[1] == 0
    assert l1.alloc.num_used_slots == used_before - new.entry.capacity_blocks
    # the old epoch's calls are no-ops: no double release, no commit of half-written slots
    l1.end_read(reading)
    l1.commit(appending, 2.0)
    l1.commit(new, 2.0)
    assert l1.match(cb)[1] == 6 and SessionId("c") not in l1.entries
    assert l1.entries[A].num_holds == 0 and l1.entries[A] is not reading
    l1.check()
    # the kept entries are live: readable, writable, evictable
    l1.begin_read(l1.entries[A])
    l1.end_read(l1.entries[A])
    assert l1.plan_write(B, cb + chain(9, base=5000)[6:], 3.0) is not None
    assert l1.evict(64, None) >= 1
    l1.check()
