"""Scenarios for DeepInfer's transfers on a second thread (rank/deepinfer_transfers.py), shared by
the stand-in tests (default suite) and the compiled-core tests (tests/deepinfer/test_deepinfer_native.py).

The loop thread runs the adapter's ``step`` as the worker does; a second thread restores a
session from L1, checks the bytes, writes it back out and gives the blocks back, over and over.
Ordering is asserted with events, never a clock.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import final

import numpy as np
import torch

from rank.deepinfer_adapter import DeepInferEngine
from rank.engine import CapacityExhausted, FinishReason
from tests.deepinfer.deepinfer_harness import BS, drive, prompt, request

WAIT_S = 60  # a bound on a hang, not a timing assert


@contextmanager
def fine_switching() -> Iterator[None]:
    """Switch threads every 10 us instead of 5 ms, so the two threads interleave inside steps."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def spilled_session(engine: DeepInferEngine, slot: int = 0) -> tuple[list[int], torch.Tensor]:
    """A finished turn whose kept blocks went to host slots from ``slot`` and were released
    (an idle session spilled to L1): its number of blocks and the slots' bytes."""
    engine.add(request("spill", prompt(5 * BS + 40, 99), 3))
    kept = list(drive(engine).terminal("spill").kept_blocks)
    engine.export_blocks(kept, slot)
    engine.release(kept)
    pool = engine.host_pool
    assert pool is not None and pool.slots is not None  # type: ignore[attr-defined]
    return kept, pool.slots[slot : slot + len(kept)].clone()  # type: ignore[attr-defined]


def tokens_of(engine: DeepInferEngine, prompts: dict[str, np.ndarray], max_tokens: int,
              restores: RestoreLoop | None = None, keep: bool = False) -> dict[str, list[int]]:
    """Every prompt to its end on the loop thread, as the worker steps (vote, then ``step``);
    counts the steps during which ``restores`` (running beside) finished one. With ``keep``,
    each finished turn's kept blocks (pinned on this thread) go to ``restores`` to write out and
    release, as the cache's write-through and eviction do."""
    for rid, ids in prompts.items():
        engine.add(request(rid, ids, max_tokens, keep=keep))
    out: dict[str, list[int]] = {}
    for _ in range(5000):
        busy = engine.lockstep_has_work()
        before = restores.restores if restores is not None else 0
        outputs = engine.step()
        if restores is not None and restores.restores != before:
            restores.during_steps += 1
        for o in outputs:
            out.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                assert o.finish_reason is FinishReason.LENGTH, o
                if o.kept_blocks:
                    assert restores is not None
                    restores.kept.put(list(o.kept_blocks))
        if not busy and not engine.has_work():
            return out
    raise AssertionError("engine did not go idle")


@final
class RestoreLoop:
    """The transfer thread's work: import the spilled session, check its bytes, export it to
    other slots, release it, until stopped. Counts what it did while the loop stepped."""

    def __init__(self, engine: DeepInferEngine, num_blocks: int, expected: torch.Tensor) -> None:
        self.engine, self.num_blocks, self.expected = engine, num_blocks, expected
        self.stop = threading.Event()
        self.kept: queue.Queue[list[int]] = queue.Queue()  # finished turns' blocks to write and release
        self.written = 0
        self.restores = 0
        self.during_steps = 0  # steps during which a restore finished (``tokens_of``)
        self.short = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="restores", daemon=True)

    def __enter__(self) -> RestoreLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kept.join()  # every finished turn's blocks written and released
        self.stop.set()
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "the restore loop hung"

    def _run(self) -> None:
        engine, n = self.engine, self.num_blocks
        pool = engine.host_pool
        assert pool is not None
        try:
            while not self.stop.is_set():
                self._write_kept()
                try:
                    ids = engine.import_blocks(0, n)
                except CapacityExhausted:
                    self.short += 1
                    continue
                rows = engine._gpu_blocks()[torch.tensor(ids)]
                assert torch.equal(rows, self.expected), "restored blocks changed under the restore"
                engine.export_blocks(ids, n)
                assert torch.equal(pool.slots[n : 2 * n], self.expected)  # type: ignore[attr-defined]
                engine.release(ids)
                self.restores += 1
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            self.error = exc
            while not self.kept.empty():  # let __exit__ return; the test reports ``error``
                self.kept.get_nowait()
                self.kept.task_done()

    def _write_kept(self) -> None:
        """Write each finished turn's blocks to the slots after the session's, then release them."""
        while not self.kept.empty():
            blocks = self.kept.get_nowait()
            slot = 2 * self.num_blocks
            self.engine.export_blocks(blocks, slot)
            rows = self.engine._gpu_blocks()[torch.tensor(blocks)]
            pool = self.engine.host_pool
            assert torch.equal(pool.slots[slot : slot + len(blocks)], rows)  # type: ignore[union-attr]
            self.engine.release(blocks)
            self.written += 1
            self.kept.task_done()


class WaitRecordingLock:
    """A lock that sets ``waited`` when an acquire finds it held: put in place of a lock under
    test, it shows that a thread waited for it without a clock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waited = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        self.waited.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def wait_until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (a bound on a hang, not a timing assert)."""
    for _ in range(int(WAIT_S * 1000)):
        if condition():
            return
        time.sleep(0.001)
    raise AssertionError("condition never held")
