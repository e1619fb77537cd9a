"""DeepInfer's L1 transfers beside ``llm.step()`` (rank/deepinfer_transfers.py), in process, CPU.

The adapter over the stand-in core (whose BlockManager mutex blocks another thread and whose
schedule holds it throughout, as the C++ does); the same scenario against DeepInfer's compiled
core is in test_deepinfer_native.py. ``DIB_TEST_DEVICE=cuda`` also runs the fence test on a GPU.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

import numpy as np
import pytest
import torch

from rank.deepinfer_transfers import DeepInferTransfers
from rank.engine import EngineMisuse
from rank.host_budget import SHM_DIR
from rank.host_pool import HostPool
from rank.pool_transfers import EXPORT_PART_ENV
from standins import fake_deepinfer
from tests.deepinfer.deepinfer_concurrency import (
    WAIT_S,
    RestoreLoop,
    WaitRecordingLock,
    fine_switching,
    spilled_session,
    tokens_of,
    wait_until,
)
from tests.deepinfer.deepinfer_harness import BS, drive, make_engine, prompt, request

DEVICE = os.environ.get("DIB_TEST_DEVICE", "cpu")


def test_restores_beside_the_steps_leave_every_request_and_block_intact() -> None:
    """The transfer thread restores, checks, writes back and releases a spilled session in a
    loop while the loop thread serves 24 requests, and writes out and releases each finished
    turn's blocks (pinned on the loop thread, so both threads change the cache refs): every
    request's tokens equal a run without the thread (the stand-in's model reads its context
    back from the pool, so a block handed to both would change them), every copy reads back its
    bytes, and the blocks balance."""
    rng = np.random.default_rng(3)
    prompts = {f"r{i}": prompt(int(rng.integers(50, 700)), i) for i in range(24)}
    reference = tokens_of(make_engine(num_gpu_blocks=160), prompts, 8)

    engine = make_engine(host_slots=64, num_gpu_blocks=160)
    kept, expected = spilled_session(engine)
    with fine_switching(), RestoreLoop(engine, len(kept), expected) as restores:
        got = tokens_of(engine, prompts, 8, restores, keep=True)
    assert restores.error is None, restores.error
    assert got == reference
    assert restores.during_steps > 0  # restores completed while the loop was inside step()
    assert restores.written == sum(1 for ids in prompts.values() if ids.size + 7 >= BS)
    engine.check_accounting()
    assert engine.stats().num_free_blocks == engine.num_blocks - 1
    assert engine.stats().num_cached_blocks == 0


def test_a_release_waits_for_the_loop_s_pin_of_the_same_block() -> None:
    """The cache refs change under one lock: while the loop thread pins a finished turn's blocks
    (one of them a prefix block the cache already holds), a release of that block on the
    transfer thread waits, and unpins only after the pin. Without the lock its check-and-change
    of the refs would interleave with the pin's."""
    engine = make_engine(host_slots=8, num_gpu_blocks=64)
    ids = prompt(3 * BS + 10, 4)
    engine.add(request("a", ids, 3))
    first = drive(engine).terminal("a")
    turn2 = np.concatenate([ids, np.asarray(first.token_ids, np.int32), prompt(40, 5)])
    engine.add(request("b", turn2, 3, prefix=list(first.kept_blocks[:2])))
    transfers, bm = engine.transfers, engine.llm.block_manager
    transfers._lock = lock = WaitRecordingLock()  # type: ignore[assignment]
    order: list[str] = []
    real_pin, real_unpin = bm.pin_blocks, bm.unpin_blocks

    def paused_pin(block_ids: list[int]) -> None:
        order.append("pin")
        wait_until(lambda: lock.waited.is_set() or "unpin" in order)
        real_pin(block_ids)
        order.append("pinned")

    def recorded_unpin(block_ids: list[int]) -> None:
        order.append("unpin")
        real_unpin(block_ids)

    bm.pin_blocks, bm.unpin_blocks = paused_pin, recorded_unpin
    release = threading.Thread(target=lambda: (wait_until(lambda: "pin" in order),
                                               engine.release([first.kept_blocks[0]])))
    release.start()
    outputs = []
    while engine.has_work():
        engine.lockstep_has_work()
        outputs.extend(engine.step())
    release.join(WAIT_S)
    assert order == ["pin", "pinned", "unpin"] and lock.waited.is_set()
    kept_b = next(o for o in outputs if o.finished).kept_blocks
    assert kept_b[0] == first.kept_blocks[0]
    engine.release(first.kept_blocks[1:])
    engine.release(kept_b)
    drive(engine)
    engine.check_accounting()
    assert engine.stats().num_free_blocks == engine.num_blocks - 1


def test_an_import_waits_while_schedule_holds_the_block_mutex() -> None:
    """DeepInfer's schedule holds the BlockManager mutex throughout (the stand-in does too); an
    import on the transfer thread takes the same mutex before it allocates, so it allocates only
    after the schedule in progress has finished with the free list."""
    engine = make_engine(host_slots=8, num_gpu_blocks=64)
    kept, _ = spilled_session(engine)
    bm, sched = engine.llm.block_manager, engine.llm.scheduler
    bm._mutex = mutex = WaitRecordingLock()
    order: list[str] = []
    real_decode, real_allocate = sched._schedule_decode, bm.allocate_nolock

    def paused_decode() -> object:
        if "schedule" not in order:
            order.append("schedule")
            wait_until(lambda: mutex.waited.is_set() or "import allocates" in order)
            order.append("scheduled")
        return real_decode()

    def recorded_allocate(n: int) -> list[int]:
        if threading.current_thread().name == "import":
            order.append("import allocates")
        return real_allocate(n)

    sched._schedule_decode, bm.allocate_nolock = paused_decode, recorded_allocate
    restored: list[int] = []
    thread = threading.Thread(name="import", target=lambda: (
        wait_until(lambda: "schedule" in order), restored.extend(engine.import_blocks(0, len(kept)))))
    thread.start()
    engine.add(request("x", prompt(200, 6), 4, keep=False))
    # drive() checks the accounting after every step; the import may still be between its
    # allocation and its refs then (it runs beside the steps), so the check waits for the join
    real_check = engine.check_accounting
    engine.check_accounting = lambda: None  # type: ignore[method-assign]
    drive(engine)
    thread.join(WAIT_S)
    engine.check_accounting = real_check  # type: ignore[method-assign]
    assert order == ["schedule", "scheduled", "import allocates"] and mutex.waited.is_set()
    engine.release(restored)
    engine.check_accounting()
    assert engine.stats().num_free_blocks == engine.num_blocks - 1


def test_transfers_finish_while_the_forward_is_in_progress() -> None:
    """Nothing the transfers need is held during DeepInfer's forward: an import, an export and a
    release started from inside ``llm.step()``'s forward finish before that forward returns."""
    engine = make_engine(host_slots=32, num_gpu_blocks=64)
    kept, expected = spilled_session(engine)
    in_forward, done = threading.Event(), threading.Event()
    real_forward = engine.llm._forward

    def held_forward(*args: object) -> object:
        if not in_forward.is_set():
            in_forward.set()
            assert done.wait(WAIT_S), "the transfers waited for the step"
        return real_forward(*args)

    engine.llm._forward = held_forward
    restored: list[int] = []

    def transfers() -> None:
        assert in_forward.wait(WAIT_S)
        restored.extend(engine.import_blocks(0, len(kept)))
        engine.export_blocks(restored, 10)
        engine.release(restored)
        done.set()

    thread = threading.Thread(target=transfers)
    thread.start()
    engine.add(request("x", prompt(300, 5), 4, keep=False))
    drive(engine)
    thread.join(WAIT_S)
    assert done.is_set() and len(restored) == len(kept)
    assert torch.equal(engine.host_pool.slots[10 : 10 + len(kept)], expected)  # type: ignore[union-attr]
    engine.check_accounting()
    assert engine.stats().num_free_blocks == engine.num_blocks - 1


def test_a_release_during_an_export_frees_the_blocks_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exports go in parts (one block each here) with ``between`` after each but the last; a
    release that lands between parts drops the cache refs at once, but the blocks come free only
    when the export ends, and the slots hold the bytes as they were. Exports take cache-held
    blocks only."""
    monkeypatch.setenv(EXPORT_PART_ENV, "1")
    engine = make_engine(host_slots=32, num_gpu_blocks=64)
    engine.add(request("a", prompt(4 * BS + 10, 7), 2))
    kept = list(drive(engine).terminal("a").kept_blocks)
    assert len(kept) == 4
    rows = engine._gpu_blocks()[torch.tensor(kept)].clone()
    free_before = engine.stats().num_free_blocks
    calls: list[tuple[int, int]] = []

    def between() -> None:
        if not calls:
            engine.release(kept)
        stats = engine.transfer_stats(engine.stats())
        calls.append((stats.num_free_blocks, stats.num_cached_blocks))

    engine.export_blocks(kept, 3, between)
    assert calls == [(free_before, 0)] * 3  # released, not freed: the export still pins them
    assert engine.stats().num_free_blocks == free_before + 4
    assert torch.equal(engine.host_pool.slots[3:7], rows)  # type: ignore[union-attr]
    engine.check_accounting()

    engine.add(request("b", prompt(3 * BS, 8), 50))
    engine.lockstep_has_work()
    engine.step()
    running = list(engine._active["b"].seq.block_table)
    with pytest.raises(EngineMisuse, match="no cache reference"):
        engine.export_blocks(running[:1], 0)  # a running sequence's block: it may still be written
    engine.abort(["b"])
    drive(engine)
    engine.check_accounting()


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(), reason="DIB_TEST_DEVICE=cuda only")
def test_an_import_waits_for_kernels_queued_before_the_fence() -> None:
    """The CUDA fence: a block freed after the step call that queued a write to it (DeepInfer's
    order: the free comes a call later, rank/deepinfer_transfers.py) is imported on the
    transfer thread; the import's copy lands after that write. The same without the fence lands
    first and is overwritten: the hazard is real on this GPU."""
    base = tempfile.mkdtemp(dir=SHM_DIR)
    try:
        pool = HostPool(os.path.join(base, "l1"), 4 << 20, pin=True)
        pool.open(1 << 20)
        pool.tensor.fill_(7)  # type: ignore[union-attr]
        for fenced in (True, False):
            bm = fake_deepinfer.BlockManager(3)
            gpu = torch.zeros(3, 1 << 20, dtype=torch.uint8, device="cuda")
            transfers = DeepInferTransfers(bm, lambda gpu=gpu: gpu, 3, pool)  # type: ignore[misc]
            if not fenced:
                transfers._fence = None
            bm.lock()
            block, other = bm.allocate_nolock(2)
            bm.unlock()
            torch.cuda._sleep(1_000_000_000)  # type: ignore[attr-defined]  # "call j-1": a kernel still queued
            gpu[block].fill_(5)
            transfers.fence()  # the record after call j-1
            bm.unpin_blocks([block])  # "call j": DeepInfer frees the block
            got: list[int] = []
            thread = threading.Thread(target=lambda got=got, t=transfers: got.extend(t.import_(0, 1)))
            thread.start()
            thread.join(WAIT_S)
            torch.cuda.synchronize()
            assert got == [block]
            value = int(gpu[block].min()), int(gpu[block].max())
            assert value == ((7, 7) if fenced else (5, 5)), (fenced, value)
            bm.unpin_blocks([block, other])
        pool.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_failed_copy_gives_the_blocks_back_and_changes_nothing() -> None:
    """An import whose copy fails (a CUDA error, say) returns its blocks to DeepInfer's free list
    and files no cache ref; the exception goes on to the transfer thread, which fails the rank."""
    engine = make_engine(host_slots=8, num_gpu_blocks=32)
    free = engine.stats().num_free_blocks
    pool = engine.host_pool
    assert pool is not None

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    pool.copy_to_device = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.import_blocks(0, 4)
    assert engine.stats().num_free_blocks == free and engine.stats().num_cached_blocks == 0
    engine.check_accounting()
