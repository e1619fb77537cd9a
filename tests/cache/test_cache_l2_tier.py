"""L2 through the cache manager, on virtual time with the store's I/O inline
(``io_threads=0``), over LocalRankGroup + the reference engine ('null': its KV rows are the
token ids, so a wrong restore would show up as wrong rows).

A "backend restart" here is a new group (new host pool), a new manager and a new store opened
on the same directory: what survives is only what is on disk."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from cache.config import CacheConfig
from cache.host_slots import HostSlots
from cache.l2_format import L2Stamp
from cache.l2_scan import read_header
from cache.l2_store import L2Store
from cache.manager import CacheManager
from cache.metrics import CacheMetrics
from rank.local_group import LocalRankGroup
from rank.reference_model import MODEL_SPECS, kv_bytes_per_block
from tests.cache.cache_harness import BLOCK_SIZE, make_group, next_prompt, run_turn, settle, tokens

pytestmark = pytest.mark.timeout(120)

SALT = "reference:test"
NULL_BYTES_PER_BLOCK = kv_bytes_per_block(MODEL_SPECS["null"], BLOCK_SIZE, torch.float32)
NULL_STAMP = L2Stamp(SALT, BLOCK_SIZE, NULL_BYTES_PER_BLOCK, "null")


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))


def _stamp(group: LocalRankGroup, layout: str = "null") -> L2Stamp:
    return L2Stamp(SALT, group.block_size, group.bytes_per_block, layout)


def _store(
    group: LocalRankGroup, directory: Path, max_bytes: int = 64 << 20, layout: str = "null"
) -> L2Store:
    assert group.host_pool_path is not None
    host = HostSlots.map_file(group.host_pool_path, group.bytes_per_block, group.num_host_slots)
    store = L2Store(str(directory), max_bytes, _stamp(group, layout), host, io_threads=0, min_free_bytes=0,
                    chunk_bytes=1 << 20)
    store.open()
    return store


def _manager(group: LocalRankGroup, store: L2Store | None, **overrides: object) -> CacheManager:
    values: dict[str, object] = {"queue_recheck_s": 0.01, "l1_write_watermark": 0.0, "hash_salt": SALT}
    values.update(overrides)
    return CacheManager(group, CacheConfig(**values), CacheMetrics(CollectorRegistry()),
                        # type: ignore[arg-type]
                        clock=asyncio.get_running_loop().time, l2=store)


async def _first_life(directory: Path, prompt: np.ndarray, **kw: object):
    """A backend's life: one turn of session 'a', L1 written through and spilled, graceful stop."""
    group = await make_group(num_blocks=96, num_ranks=2)
    store = _store(group, directory, **kw)
    mgr = _manager(group, store)
    try:
        turn = await run_turn(mgr, group, prompt, "a")
        await mgr.drain()
        await mgr.close()
        await settle(mgr, group)
        return turn, store.counters
    finally:
        await group.close()
        store.close()


async def _second_life(directory: Path, prompt: np.ndarray, layout: str = "null", vanish: bool = False):
    group = await make_group(num_blocks=96, num_ranks=2)
    store = _store(group, directory, layout=layout)
    if vanish:  # the directory disappears after the index was read (an unmounted disk, rm -rf)
        shutil.rmtree(directory)
    mgr = _manager(group, store)
    try:
        turn = await run_turn(mgr, group, prompt, "a")
        await settle(mgr, group)
        return turn, store
    finally:
        await group.close()
        store.close()


def test_a_new_backend_restores_the_session_from_disk(tmp_path: Path) -> None:
    async def main() -> None:
        rng = np.random.default_rng(1)
        first, saved = await _first_life(tmp_path, tokens(rng, 300))
        assert saved.saved_blocks >= 18
        follow = next_prompt(first, tokens(rng, 7))
        again, store = await _second_life(tmp_path, follow)
        adm = again.admission
        assert adm.cached_tokens_by_tier.l0 == adm.cached_tokens_by_tier.l1 == 0
        assert adm.cached_tokens_by_tier.l2 == adm.num_cached_tokens >= 0.9 * len(follow)
        assert store.counters.loaded_blocks * BLOCK_SIZE >= adm.num_cached_tokens
        # Control: the same turn on a backend without L2 recomputes everything.
        group = await make_group(num_blocks=96, num_ranks=2)
        try:
            cold = await run_turn(_manager(group, None), group, follow, "a")
            assert cold.admission.num_cached_tokens == 0
            assert cold.output_ids == again.output_ids  # restored KV == computed KV (null model)
        finally:
            await group.close()

    asyncio.run(main())


def test_a_corrupted_extent_through_the_manager_restores_the_verified_prefix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        rng = np.random.default_rng(2)
        first, _ = await _first_life(tmp_path, tokens(rng, 300))
        (name,) = [n for n in os.listdir(tmp_path) if n.endswith(".kv")]
        path = str(tmp_path / name)
        header, _, _ = read_header(path, NULL_STAMP)
        _flip_byte(path, header.payload_offset + 10 * NULL_STAMP.bytes_per_block + 3)  # in chain block 10
        follow = next_prompt(first, tokens(rng, 7))
        with caplog.at_level(logging.WARNING, logger="cache.l2_store"):
            again, store = await _second_life(tmp_path, follow)
        adm = again.admission
        assert adm.num_cached_tokens == adm.cached_tokens_by_tier.l2 == 10 * BLOCK_SIZE
        assert "failed its checksum at chain block 10" in caplog.text
        assert store.counters.rejected_extents == 1 and name not in os.listdir(tmp_path)

    asyncio.run(main())


@pytest.mark.parametrize("damage", ["truncated", "foreign", "vanished"])
def test_truncated_foreign_or_vanished_files_are_never_loaded_and_the_turn_recomputes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    async def main() -> None:
        rng = np.random.default_rng(3)
        first, _ = await _first_life(tmp_path, tokens(rng, 300))
        layout = "null"
        (name,) = [n for n in os.listdir(tmp_path) if n.endswith(".kv")]
        if damage == "truncated":
            path = tmp_path / name
            os.truncate(path, os.path.getsize(path) - 4096)
        else:
            layout = "another-model-layout"  # the next backend's stamp differs: the file is foreign to it
        follow = next_prompt(first, tokens(rng, 7))
        with caplog.at_level(logging.INFO):
            again, store = await _second_life(tmp_path, follow, layout=layout, vanish=damage == "vanished")
        assert again.admission.num_cached_tokens == 0 and len(again.output_ids) == 8
        assert store.counters.loaded_blocks == 0 and name not in os.listdir(tmp_path)  # deleted at open
        assert (damage if damage != "vanished" else f"directory {tmp_path} is gone") in caplog.text

    asyncio.run(main())


def test_spills_keep_the_disk_under_its_bound(tmp_path: Path) -> None:
    async def main() -> None:
        group = await make_group(num_blocks=96, num_ranks=2, host_slots=64)
        # The null model's rows are 64 B: one session's extent is 8 KiB (4 KiB aligned header + payload).
        bound = 40 << 10
        store = _store(group, tmp_path, max_bytes=bound)
        mgr = _manager(group, store)
        rng = np.random.default_rng(4)
        try:
            for i in range(8):
                await run_turn(mgr, group, tokens(rng, 300), f"s{i}")
                await mgr.drain()
                on_disk = sum(os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path))
                assert on_disk <= bound, (i, on_disk)
                assert store.index.used_bytes <= bound
            assert store.counters.saved_blocks >= 8 * 18 and store.counters.evicted_extents >= 3
            await settle(mgr, group)
        finally:
            await group.close()
            store.close()

    asyncio.run(main())


def test_a_full_disk_costs_the_spill_never_the_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ENOSPC on every write of the first backend: its turn answers as usual, nothing lands on
    disk (no extent, no leftover .tmp), the failure is counted and logged; the next backend finds
    nothing, recomputes, and spills again once the disk has room."""
    import cache.l2_store

    def disk_full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    async def main() -> None:
        rng = np.random.default_rng(5)
        prompt = tokens(rng, 300)
        with monkeypatch.context() as patch:
            patch.setattr(cache.l2_store, "write_at", disk_full)
            with caplog.at_level(logging.WARNING, logger="cache.l2_store"):
                first, counters = await _first_life(tmp_path, prompt)
        assert len(first.output_ids) == 8
        assert counters.write_errors >= 1 and counters.saved_blocks == 0
        assert "No space left on device" in caplog.text
        assert os.listdir(tmp_path) == []
        follow = next_prompt(first, tokens(rng, 7))
        again, store = await _second_life(tmp_path, follow)
        assert again.admission.num_cached_tokens == 0 and len(again.output_ids) == 8
        assert store.counters.saved_blocks >= 18  # the disk has room again: this turn spilled
        assert any(n.endswith(".kv") for n in os.listdir(tmp_path))

    asyncio.run(main())
