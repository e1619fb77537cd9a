"""The shared L1 host pool: two mappings of one /dev/shm file see each other's bytes."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from hypothesis import given, strategies as st

from rank import host_pool as host_pool_module
from rank.block_manager import BlockManager
from rank.host_budget import host_pool_path, plan_host_pool_bytes, unlink_host_pool
from rank.host_pool import DIRECT_MIN_RUN_BYTES, HostPool, by_kernel, by_runs, copy_plan, runs
from rank.pool_transfers import PoolTransfers


def test_two_mappings_share_bytes_and_unlink_removes_the_file() -> None:
    path = host_pool_path(f"test-{os.getpid()}")
    unlink_host_pool(path)
    a, b = HostPool(path, 10_000, pin=False), HostPool(path, 10_000, pin=False)
    try:
        a.open(1024)
        b.open(1024)
        assert a.num_slots == b.num_slots == 9
        device = torch.arange(4 * 1024, dtype=torch.int64).remainder(251).to(torch.uint8).view(4, 1024)
        a.copy_from_device(device, [3, 1], 7)
        back = torch.zeros_like(device)
        b.copy_to_device(back, [0, 2], 7)
        assert torch.equal(back[0], device[3]) and torch.equal(back[2], device[1])
        with pytest.raises(ValueError):
            a.copy_from_device(device, [0, 1, 2], 7)  # past the last slot
        with pytest.raises(ValueError):
            a.open(2048)  # geometry is fixed once open
    finally:
        a.close()
        b.close()
        unlink_host_pool(path)
    assert not os.path.exists(path)


def test_runs_split_ids_where_they_stop_being_consecutive() -> None:
    assert runs([5, 6, 7, 2, 3, 9]) == [(5, 0, 3), (2, 3, 2), (9, 5, 1)]
    assert runs([4]) == [(4, 0, 1)]
    assert runs([3, 2, 1]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]  # descending ids are not a run


def test_an_import_takes_its_free_rows_in_order(tmp_path: os.PathLike[str]) -> None:
    """The free list hands rows out in release order; an import sorts them, so the restore's
    rows form the longest runs of consecutive ids (one copy per run, ``rank/host_pool.py``)."""
    host = HostPool(os.path.join(str(tmp_path), "l1"), 8 * 16, pin=False)
    host.open(16)
    try:
        assert host.tensor is not None
        host.tensor[:6] = torch.arange(6 * 16, dtype=torch.uint8).view(6, 16)
        blocks = BlockManager(13)
        blocks.allocate(12)
        blocks.decref([2, 9, 5, 11, 3, 7])  # free list now 7, 3, 11, 5, 9, 2
        pool = torch.zeros(13, 16, dtype=torch.uint8)
        ids = PoolTransfers(blocks, host, torch.device("cpu")).import_(pool, 0, 6)
        assert ids == [2, 3, 5, 7, 9, 11]
        assert torch.equal(pool[ids], host.tensor[:6])
    finally:
        host.close()


@pytest.mark.parametrize(("block_bytes", "ids", "calls"), [
    (DIRECT_MIN_RUN_BYTES, [1, 3, 5, 7], ["runs"]),  # runs of one row, each a whole MiB
    (DIRECT_MIN_RUN_BYTES // 2, [1, 2, 3, 4], ["runs"]),  # one run of 2 MiB
    (DIRECT_MIN_RUN_BYTES // 2, [1, 2, 5, 6], ["runs"]),  # two runs of exactly 1 MiB
    (DIRECT_MIN_RUN_BYTES // 2, [1, 2, 3, 7], ["runs"]),  # 1.5 MiB, then a lone short run
    (DIRECT_MIN_RUN_BYTES // 2, [1, 2, 4, 7], ["runs", "kernel"]),  # 1 MiB, then two short runs
    (DIRECT_MIN_RUN_BYTES // 2, [1, 3, 5, 7], ["kernel"]),
    # a fragmented free list's holes first, then one long run (a big restore into a busy pool):
    # the holes together by the kernel, the run by itself (the average alone said "per run")
    (DIRECT_MIN_RUN_BYTES // 4, [1, 3, 5, 7, 9, 11, 20, 21, 22, 23, 24, 25, 26, 27], ["kernel", "runs"]),
])
def test_long_runs_are_copied_directly_and_adjacent_short_runs_together(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch, block_bytes: int, ids: list[int],
        calls: list[str]) -> None:
    chosen: list[tuple[str, int]] = []
    monkeypatch.setattr(host_pool_module, "by_runs", lambda r, s, *a: chosen.append(("runs", len(s))))
    monkeypatch.setattr(host_pool_module, "by_kernel", lambda r, s, *a: chosen.append(("kernel", len(s))))
    host = HostPool(os.path.join(str(tmp_path), "l1"), len(ids) * block_bytes, pin=False)
    host.open(block_bytes)
    try:
        assert host.tensor is not None
        host._copy(torch.empty(0), host.tensor, ids, 0, to_device=True)
        host._copy(torch.empty(0), host.tensor, ids, 0, to_device=False)
    finally:
        host.close()
    assert [c for c, _ in chosen] == calls + calls
    assert sum(n for _, n in chosen) == 2 * len(ids)  # every slot moved once each way


@given(st.lists(st.integers(0, 40), unique=True, min_size=1, max_size=24), st.integers(1, 6))
def test_copy_plan_covers_every_block_once_in_order(ids: list[int], min_run: int) -> None:
    plan = copy_plan(ids, min_run)
    assert [i for _, a, b in plan for i in range(a, b)] == list(range(len(ids)))
    for direct, a, b in plan:
        stretch = runs(ids[a:b])
        if not direct:  # two or more adjacent short runs, nothing else
            assert len(stretch) >= 2 and all(n < min_run for _, _, n in stretch)
    assert all(not (x[0] and y[0]) for x, y in itertools.pairwise(plan))  # direct ones merged


@given(st.permutations(range(12)).flatmap(lambda p: st.integers(1, 12).map(lambda n: p[:n])))
def test_both_copy_paths_move_the_same_bytes_both_ways(ids: list[int]) -> None:
    """``by_runs`` (a copy per run) and ``by_kernel`` (staging + index kernel) are interchangeable:
    slots -> rows and rows -> slots give byte-identical results for any order of distinct ids."""
    slots = torch.arange(len(ids) * 8, dtype=torch.int64).remainder(251).to(torch.uint8).view(len(ids), 8)
    rows = {}
    for name, copy in (("runs", lambda r, s: by_runs(r, s, runs(ids), True, False)),
                       ("kernel", lambda r, s: by_kernel(r, s, ids, True, False))):
        rows[name] = torch.zeros(12, 8, dtype=torch.uint8)
        copy(rows[name], slots)
        assert torch.equal(rows[name][ids], slots)
    assert torch.equal(rows["runs"], rows["kernel"])  # and nothing else was written
    back = {}
    for name, copy in (("runs", lambda r, s: by_runs(r, s, runs(ids), False, False)),
                       ("kernel", lambda r, s: by_kernel(r, s, ids, False, False))):
        back[name] = torch.zeros_like(slots)
        copy(rows["runs"], back[name])
    assert torch.equal(back["runs"], slots) and torch.equal(back["kernel"], slots)


def test_budget_is_lowered_to_what_the_machine_allows() -> None:
    budget, reason = plan_host_pool_bytes(1e6, 4)  # an absurd ask
    assert 0 < budget < int(1e6 * (1 << 30))
    assert "L1 host pool" in reason


@pytest.mark.timeout(240)
def test_pool_bytes_survive_a_rank_sigkill() -> None:
    """The pool file outlives a rank-group restart. Blocks exported before a
    rank is SIGKILLed are byte-identical after it, in the backend's own mapping of the file, and
    the next epoch's ranks import them (re-exported elsewhere, they still match)."""
    import asyncio
    import signal

    import numpy as np

    from rank.engine import EngineRequest, SamplingParams
    from rank.group import RankGroup
    from server.config import WorkloadConfig
    from tests.rank.rank_stream_helpers import collect

    config = WorkloadConfig(reference_model="null", ep=2, block_size=16, reference_num_blocks=64,
                            max_num_batched_tokens=256, l1_host_gb=0.001).rank_config()

    async def scenario() -> None:
        group = RankGroup(config)
        await group.start()
        path = group.host_pool_path
        try:
            prompt = np.random.default_rng(7).integers(3, 129_280, 100).astype(np.int32)
            request = EngineRequest("a", prompt, SamplingParams(2, ignore_eos=True))
            _, last = await collect(group.submit(0, request))
            kept = list(last.kept_blocks)
            n, bpb = len(kept), group.bytes_per_block
            await group.export_blocks(0, kept, 3)
            pool = np.memmap(path, dtype=np.uint8, mode="r", shape=(group.num_host_slots, bpb))
            before = np.array(pool[3 : 3 + n])
            assert before.any(), "the export wrote nothing: the test would prove nothing"
            os.kill(group.pids()[1], signal.SIGKILL)
            for _ in range(600):
                if group.epoch == 2:
                    break
                await asyncio.sleep(0.05)
            await group.wait_ready(120)
            assert group.epoch == 2 and os.path.exists(path)
            assert np.array_equal(pool[3 : 3 + n], before)
            ids = await group.import_blocks(1, 3, n)
            await group.export_blocks(1, ids, 3 + n)
            assert np.array_equal(pool[3 + n : 3 + 2 * n], before)
            await group.release(1, ids)
        finally:
            await group.close()
        assert not os.path.exists(path)

    asyncio.run(scenario())
