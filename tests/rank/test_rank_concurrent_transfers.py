"""Imports and exports on a second thread while the reference engine steps.

In process, real threads, CPU: the transfer thread's side of ``rank/transfers.py`` calls
``import_blocks``/``export_blocks``, and ``release`` for some of its restores, while the main
thread runs ``step``; the other releases run on the main thread between steps, as forwarded ones
do in the worker. Ordering is asserted with events, never a clock.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from rank.block_manager import BlockManager
from rank.engine import CapacityExhausted, EngineMisuse, EngineRequest, SamplingParams
from rank.host_budget import SHM_DIR
from rank.host_pool import HostPool
from rank.reference_engine import ReferenceEngine, ReferenceEngineConfig

BLOCK = 16
WAIT_S = 60  # a bound on a hang, not a timing assert
# DIB_TEST_DEVICE=cuda runs the same tests on a GPU (side stream, fence, pinned L1): the CPU run
# cannot show the CUDA ordering these rest on.
DEVICE = os.environ.get("DIB_TEST_DEVICE", "cpu")


@pytest.fixture(params=["tiny", "null"])
def engine(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> Iterator[ReferenceEngine]:
    # Pinning needs the tmpfs the product uses (rank/host_budget.py: /dev/shm); cudaHostRegister
    # of a file mapping on a disk filesystem fails (seen on the H200 host: error 1).
    base = str(tmp_path) if DEVICE == "cpu" else tempfile.mkdtemp(dir=SHM_DIR)
    pool = HostPool(os.path.join(base, "l1"), 1 << 21, pin=DEVICE == "cuda")
    eng = ReferenceEngine(
        ReferenceEngineConfig(model=request.param, block_size=BLOCK, num_blocks=96, max_num_seqs=8,
                              max_num_batched_tokens=64, max_model_len=400, device=DEVICE),
        pool,
    )
    yield eng
    eng.close()
    pool.close()
    if base != str(tmp_path):
        shutil.rmtree(base, ignore_errors=True)


def req(rid: str, n: int, max_tokens: int, keep: bool = False, offset: int = 0) -> EngineRequest:
    ids = (np.arange(n, dtype=np.int32) * 7 + 100 + offset) % 1000 + 3
    return EngineRequest(rid, ids.astype(np.int32), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         keep_blocks=keep)


def run_all(engine: ReferenceEngine,
            between_steps: list[Callable[[], None]] | None = None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(5000):
        if not engine.has_work():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        if between_steps is not None:
            for fn in between_steps:
                fn()
    raise AssertionError("engine did not go idle")


def cached_blocks(engine: ReferenceEngine, rid: str, n: int) -> list[int]:
    engine.add(req(rid, n, 2, keep=True, offset=500))
    kept: list[int] = []
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                kept = [int(b) for b in out.kept_blocks]
    assert kept
    return kept


def test_transfers_finish_while_a_step_is_in_progress(engine: ReferenceEngine) -> None:
    """The step holds no lock the transfers need: an export and an import started from inside a
    step's forward complete before that forward returns."""
    kept = cached_blocks(engine, "src", 5 * BLOCK + 3)
    in_step, transfers_done = threading.Event(), threading.Event()
    real_forward = engine._forward
    held = []

    def slow_forward(*args: object) -> object:
        if not held:
            held.append(True)
            in_step.set()
            assert transfers_done.wait(WAIT_S), "transfers waited for the step"
        return real_forward(*args)  # type: ignore[arg-type]

    engine._forward = slow_forward  # type: ignore[method-assign]
    imported: list[int] = []

    def transfer() -> None:
        assert in_step.wait(WAIT_S)
        engine.export_blocks(kept, 0)
        imported.extend(engine.import_blocks(0, len(kept)))
        transfers_done.set()

    thread = threading.Thread(target=transfer)
    thread.start()
    engine.add(req("long", 3 * BLOCK, 4))
    out = run_all(engine)
    thread.join(WAIT_S)
    assert transfers_done.is_set() and len(out["long"]) == 4
    assert torch.equal(engine.pool[imported], engine.pool[kept])  # byte-exact through L1
    engine.check_accounting()
    engine.release(imported)
    engine.release(kept)
    engine.check_accounting()
    assert engine.stats().num_free_blocks == engine.num_blocks - 1


def test_greedy_output_and_accounting_exact_under_concurrent_restores(engine: ReferenceEngine) -> None:
    """Many imports/exports, and releases of half the restores, on a second thread while greedy
    requests (and aborted ones) step: the same tokens as without them, and the block bookkeeping
    exact at the end."""
    kept = cached_blocks(engine, "src", 4 * BLOCK + 1)
    engine.export_blocks(kept, 0)
    prompts = {f"r{i}": (20 + 13 * i, 6 + i % 4) for i in range(6)}
    for rid, (n, max_tokens) in prompts.items():
        engine.add(req(rid, n, max_tokens, offset=len(rid) * 31 + n))
    baseline = run_all(engine)
    engine.check_accounting()

    to_release: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
    stop = threading.Event()
    counts = {"imports": 0, "exports": 0, "refused": 0, "thread_releases": 0}
    outstanding = threading.Semaphore(2)  # restores the loop thread has not released yet

    def hammer() -> None:
        slot = 10
        while not stop.is_set():
            if not outstanding.acquire(timeout=0.01):
                continue
            try:
                ids = engine.import_blocks(0, len(kept))
            except CapacityExhausted:
                counts["refused"] += 1
                outstanding.release()
                stop.wait(0.001)
                continue
            counts["imports"] += 1
            engine.export_blocks(ids, slot)  # the restored copy goes back out to other slots
            counts["exports"] += 1
            slot = 10 + (slot + len(ids)) % 40
            if counts["imports"] % 2:  # half the releases on this thread, beside the step
                engine.release(ids)
                counts["thread_releases"] += 1
                outstanding.release()
            else:
                to_release.put(ids)

    def release_queued() -> None:  # the loop thread's releases, between steps
        while not to_release.empty():
            engine.release(to_release.get())
            outstanding.release()

    aborts = iter([["a1"], ["a3"]])

    def abort_some() -> None:
        batch = next(aborts, None)
        if batch is not None:
            engine.abort(batch)

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        for rid, (n, max_tokens) in prompts.items():
            engine.add(req(rid, n, max_tokens, offset=len(rid) * 31 + n))
        for i in range(4):
            engine.add(req(f"a{i}", 40 + i, 50))
        concurrent = run_all(engine, [release_queued, abort_some])
    finally:
        stop.set()
        thread.join(WAIT_S)
    release_queued()
    assert counts["imports"] > 0 and counts["exports"] == counts["imports"]
    assert counts["thread_releases"] == (counts["imports"] + 1) // 2 > 0
    assert {rid: concurrent[rid] for rid in prompts} == baseline
    engine.check_accounting()
    engine.release(kept)
    engine.check_accounting()
    assert engine.stats().num_free_blocks == engine.num_blocks - 1
    print(f"\n{counts['imports']} imports, {counts['exports']} exports, {counts['thread_releases']} "
          f"releases beside the steps ({counts['refused']} refused: pool full)")


def test_refused_transfers_change_nothing(engine: ReferenceEngine) -> None:
    before = engine.stats()
    with pytest.raises(CapacityExhausted):
        engine.import_blocks(0, engine.num_blocks)
    with pytest.raises(EngineMisuse):
        engine.import_blocks(-1, 1)
    with pytest.raises(EngineMisuse):
        engine.export_blocks([1], 0)  # a free block
    assert engine.stats() == before
    engine.check_accounting()


def test_a_release_during_an_export_frees_the_blocks_after_it() -> None:
    """The export's pin keeps a released block off the free list until the copy is done."""
    bm = BlockManager(8)
    ids = bm.allocate(2, cache_ref=True)
    bm.pin_held(ids, what="export")
    bm.validate_held(ids, what="release", need_cache_ref=True)
    bm.decref(ids, cache_ref=True)  # the release lands mid-copy
    assert bm.num_free_blocks == 5 and all(bm.ref_counts[b] == 1 for b in ids)
    bm.check({})  # the pins are counted
    bm.unpin(ids)
    assert bm.num_free_blocks == 7
    bm.check({})
    with pytest.raises(EngineMisuse):
        bm.pin_held([ids[0]], what="export")  # free now


def test_a_release_checks_and_drops_its_refs_in_one_critical_section() -> None:
    """``release_held``: a refused release changes nothing; one block released twice over is
    refused (never an underflow), the second copy of a shared block's refs is not."""
    bm = BlockManager(8)
    ids = bm.allocate(3, cache_ref=True)
    bm.incref([ids[0]])
    bm.to_cache([ids[0]])  # two cache refs on ids[0]
    with pytest.raises(EngineMisuse):
        bm.release_held([ids[1], 0], what="release")
    with pytest.raises(EngineMisuse):
        bm.release_held([ids[1], ids[1]], what="release")
    assert bm.num_free_blocks == 4
    bm.check({})
    bm.release_held(ids, what="release")
    assert bm.num_free_blocks == 6 and bm.cache_refs[ids[0]] == 1
    with pytest.raises(EngineMisuse, match="is free"):
        bm.release_held([ids[1]], what="release")
    bm.release_held([ids[0]], what="release")
    assert bm.num_free_blocks == 7
    bm.check({})


def test_failed_import_copy_gives_its_blocks_back(engine: ReferenceEngine,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine.host_pool is not None

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(engine.host_pool, "copy_to_device", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        engine.import_blocks(0, 3)
    engine.check_accounting()
    assert engine.stats().num_free_blocks == engine.num_blocks - 1


def test_an_export_in_parts_lets_commands_run_between_them_with_its_blocks_pinned(
        engine: ReferenceEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """``export_blocks(..., between)``: parts of at most ``DIB_EXPORT_PART_BYTES``; between them
    an import runs and a release of one of the export's blocks lands, which frees it only after
    the export; the slots hold the blocks' bytes as they were."""
    from rank.pool_transfers import EXPORT_PART_ENV

    monkeypatch.setenv(EXPORT_PART_ENV, str(2 * engine.bytes_per_block))
    kept = cached_blocks(engine, "src", 5 * BLOCK + 3)  # 5 full blocks: parts of 2, 2, 1
    engine.export_blocks(kept, 0)
    before = engine.pool[kept].clone()
    calls: list[int] = []
    imported: list[int] = []

    def between() -> None:
        calls.append(engine.stats().num_free_blocks)
        if len(calls) == 1:
            imported.extend(engine.import_blocks(0, 2))
            engine.release([kept[4]])  # its part is not copied yet: pinned, not freed

    free = engine.stats().num_free_blocks
    engine.export_blocks(kept, 20, between)
    assert len(calls) == 2  # after parts 1 and 2, not after the last
    assert calls == [free, free - 2]  # the release freed nothing while the export ran
    assert engine.stats().num_free_blocks == free - 2 + 1  # kept[4] free once unpinned
    assert engine.host_pool is not None
    slots = engine.host_pool.tensor[20:25]
    assert torch.equal(slots.to(before.device), before)
    assert torch.equal(engine.pool[imported], engine.pool[kept[:2]])
    engine.release([*kept[:4], *imported])
    engine.check_accounting()
    assert engine.stats().num_free_blocks == engine.num_blocks - 1
