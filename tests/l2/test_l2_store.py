"""L2 store on a real directory: round trips, restart, rejected files, the disk bound, faults."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import itertools
import logging
import os
import shutil

import numpy as np
import pytest

from cache.host_slots import HostSlots
from cache.l2_format import ExtentHeader
from cache.l2_scan import read_header
from tests.l2.l2_helpers import HASHER, ODD_BPB, STAMP, chain, disk_bytes, files, fill, make_store, run


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("bpb", [ODD_BPB, 16_384], ids=["odd-rows", "aligned-rows"])
def test_save_then_load_round_trips_bytes(tmp_path, direct: bool, bpb: int) -> None:
    stamp = dataclasses.replace(STAMP, bytes_per_block=bpb)
    store = make_store(str(tmp_path), stamp=stamp, direct=direct)
    c = chain(150)  # 1.8-2.4 MB: a few chunks of 1 MiB
    data = fill(store.host, 0, 150, seed=1)
    assert run(store.save(c, HASHER.root, 0)) == 150
    assert store.match(c) == 150 and store.match(chain(151)) == 150
    assert run(store.load(c, 0, 150, 100)) == 150
    assert np.array_equal(store.host.array[100:250], data)
    # a run from the middle of the chain into other slots
    store.host.array[:] = 0
    assert run(store.load(c, 37, 80, 3)) == 80
    assert np.array_equal(store.host.array[3:83], data[37:117])
    store.index.check()
    store.close()


def test_growing_session_adds_suffix_extents_and_shares_prefix(tmp_path) -> None:
    store = make_store(str(tmp_path))
    c = chain(40)
    fill(store.host, 0, 40, seed=2)
    assert run(store.save(c[:25], HASHER.root, 0)) == 25
    assert run(store.save(c, HASHER.root, 0)) == 15  # only the new blocks
    assert run(store.save(c, HASHER.root, 0)) == 0
    assert len(files(str(tmp_path))) == 2
    other = HASHER.hashes(list(range(4 * 10)) + list(range(5000, 5000 + 4 * 6)))  # shares 10 blocks
    fill(store.host, 100, 16, seed=3)
    assert run(store.save(other, HASHER.root, 100)) == 6
    assert store.match(other) == 16
    store.close()


def test_index_survives_a_restart_with_lru_order(tmp_path) -> None:
    d = str(tmp_path)
    store = make_store(d)
    chains = [chain(10, base=1000 * i) for i in range(3)]
    data = [fill(store.host, 10 * i, 10, seed=i) for i in range(3)]
    for i, c in enumerate(chains):
        run(store.save(c, HASHER.root, 10 * i))
    store.close()
    # The LRU order lives in the files' mtimes: chain 0 oldest, chain 2 newest.
    for age, c in zip((300, 200, 100), chains):
        (name,) = [n for n in files(d) if n.startswith(f"{c[0]:016x}-")]
        os.utime(os.path.join(d, name), (1e9 - age, 1e9 - age))

    store2 = make_store(d, host=HostSlots.in_memory(ODD_BPB, 64))
    assert [store2.match(c) for c in chains] == [10, 10, 10]
    assert run(store2.load(chains[1], 0, 10, 0)) == 10
    assert np.array_equal(store2.host.array[:10], data[1])
    store2.index.check()
    lru = sorted(store2.index.extents.values(), key=lambda e: e.last_used_s)
    assert [e.hashes[0] for e in lru] == [chains[0][0], chains[2][0], chains[1][0]]  # the load touched 1
    store2.close()


def test_corrupted_block_cuts_the_restore_and_drops_the_extent(tmp_path, caplog) -> None:
    d = str(tmp_path)
    store = make_store(d)
    c = chain(30)
    data = fill(store.host, 0, 30, seed=5)
    run(store.save(c[:12], HASHER.root, 0))
    run(store.save(c, HASHER.root, 0))  # second extent holds blocks 12..29
    second = next(n for n in files(d) if "-18-" in n)
    header, _, _ = read_header(os.path.join(d, second), STAMP)
    with open(os.path.join(d, second), "r+b") as f:  # flip one byte of chain block 20
        f.seek(header.payload_offset + (20 - 12) * ODD_BPB + 77)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x55]))
    store.host.array[:] = 0
    with caplog.at_level(logging.WARNING, logger="cache.l2_store"):
        got = run(store.load(c, 0, 30, 0))
    assert got == 20  # blocks 0..19 verified, 20 failed its checksum
    assert np.array_equal(store.host.array[:20], data[:20])
    assert "failed its checksum at chain block 20" in caplog.text
    assert store.match(c) == 12 and store.counters.rejected_extents == 1
    store.close()
    assert second not in files(d)  # deleted (asynchronously, before close returned)


def test_truncated_file_is_rejected_while_running_and_at_restart(tmp_path, caplog) -> None:
    d = str(tmp_path)
    store = make_store(d)
    c = chain(20)
    fill(store.host, 0, 20, seed=6)
    run(store.save(c, HASHER.root, 0))
    (name,) = files(d)
    size = os.path.getsize(os.path.join(d, name))
    os.truncate(os.path.join(d, name), size - 3 * ODD_BPB)
    with caplog.at_level(logging.WARNING):
        assert run(store.load(c, 0, 20, 0)) < 20  # the blocks past the cut are never handed out
    assert "unreadable" in caplog.text and store.match(c) == 0
    store.close()

    fill(store.host, 0, 20, seed=6)
    store = make_store(d)
    run(store.save(c, HASHER.root, 0))
    (name,) = files(d)
    store.close()
    os.truncate(os.path.join(d, name), os.path.getsize(os.path.join(d, name)) // 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        store = make_store(d)
    assert store.match(c) == 0 and files(d) == []
    assert "rejected" in caplog.text and "truncated" in caplog.text
    store.close()


def test_foreign_and_unknown_files_are_never_loaded(tmp_path, caplog) -> None:
    d = str(tmp_path)
    c = chain(8)
    other_model = dataclasses.replace(STAMP, model="reference:another-model")
    foreign = make_store(d, stamp=other_model)
    fill(foreign.host, 0, 8, seed=7)
    run(foreign.save(c, HASHER.root, 0))  # same hashes, another model's bytes
    foreign.close()
    with open(os.path.join(d, "notes.kv"), "wb") as f:
        f.write(b"operator's file, not an extent" * 200)
    with caplog.at_level(logging.WARNING):
        store = make_store(d)
    assert store.match(c) == 0
    assert "foreign" in caplog.text and "another-model" in caplog.text and "not ours" in caplog.text
    assert files(d) == ["notes.kv"]  # the foreign extent deleted, the unknown file left alone
    store.close()


def test_disk_bound_is_held_with_lru_eviction(tmp_path) -> None:
    d = str(tmp_path)
    per_extent = ExtentHeader(STAMP, 0, HASHER.root, chain(10), [0] * 10).file_bytes
    bound = 3 * per_extent + per_extent // 2
    store = make_store(d, max_bytes=bound, clock=itertools.count().__next__)
    chains = [chain(10, base=1000 * i) for i in range(8)]
    for i, c in enumerate(chains):
        fill(store.host, 0, 10, seed=i)
        assert run(store.save(c, HASHER.root, 0)) == 10
        if i == 4:
            run(store.load(chains[2], 0, 10, 20))  # chain 2 is used again: it outlives 3 and 4
        if i == 6:
            assert [store.match(c) > 0 for c in chains[2:7]] == [True, False, False, True, True]
        assert store.index.used_bytes <= bound
    store.close()
    assert disk_bytes(d) <= bound
    assert [store.match(c) > 0 for c in chains] == [False, False, False, False, False, True, True, True]
    assert store.counters.evicted_extents == 5
    big = make_store(d, max_bytes=bound)
    fill(big.host, 0, 40, seed=9)
    assert run(big.save(chain(40, base=99_000), HASHER.root, 0)) == 0  # larger than the bound: skipped
    assert big.counters.skipped_saves == 1 and disk_bytes(d) <= bound
    big.close()


def test_disk_full_degrades_to_not_cached(tmp_path, monkeypatch, caplog) -> None:
    d = str(tmp_path)
    store = make_store(d)
    c = chain(30)
    fill(store.host, 0, 30, seed=10)
    real_pwrite = os.pwrite

    def full(fd: int, data, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with caplog.at_level(logging.WARNING):
        assert run(store.save(c, HASHER.root, 0)) == 0
    assert "No space left" in caplog.text and store.counters.write_errors == 1
    assert os.listdir(d) == [] and store.match(c) == 0 and store.index.reserved_bytes == 0
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert run(store.save(c, HASHER.root, 0)) == 30  # space came back: it works again
    store.close()


def test_nearly_full_disk_lowers_the_bound(tmp_path, caplog) -> None:
    d = str(tmp_path)
    free = {"bytes": 1 << 40}
    store = make_store(d, free_bytes=lambda _: free["bytes"], min_free_bytes=1 << 20)
    for i in range(4):
        fill(store.host, 0, 10, seed=i)
        run(store.save(chain(10, base=1000 * i), HASHER.root, 0))
    used = store.index.used_bytes
    free["bytes"] = (1 << 20) + 100  # someone else filled the disk
    fill(store.host, 0, 10, seed=5)
    with caplog.at_level(logging.WARNING):
        run(store.save(chain(10, base=9000), HASHER.root, 0))
    assert "has room for" in caplog.text
    assert store.index.used_bytes <= used + 100 and store.index.max_bytes < used + 200
    store.close()


def test_vanished_directory_degrades_and_recovers(tmp_path, caplog) -> None:
    d = str(tmp_path / "l2")
    store = make_store(d)
    c = chain(12)
    fill(store.host, 0, 12, seed=11)
    run(store.save(c, HASHER.root, 0))
    shutil.rmtree(d)
    with caplog.at_level(logging.WARNING):
        assert run(store.load(c, 0, 12, 20)) == 0
    assert "is gone" in caplog.text and store.match(c) == 0
    assert run(store.save(c, HASHER.root, 0)) == 12  # the directory is recreated
    assert run(store.load(c, 0, 12, 20)) == 12
    store.close()


def test_cancelled_load_waits_for_its_chunks(tmp_path) -> None:
    store = make_store(str(tmp_path), chunk_bytes=1 << 20)
    c = chain(200)
    data = fill(store.host, 0, 200, seed=12)
    run(store.save(c, HASHER.root, 0))

    async def cancel_midway() -> None:
        task = asyncio.ensure_future(store.load(c, 0, 200, 0))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Once the cancelled call returned, no chunk of it is still writing the slots.
        store.host.array[:200] = data
        await asyncio.sleep(0.05)
        assert np.array_equal(store.host.array[:200], data)

    run(cancel_midway())
    store.close()
