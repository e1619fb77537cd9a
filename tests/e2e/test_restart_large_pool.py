"""Time to ready after a rank SIGKILL with a large L1 pool, beside a small one (figures, printed).

A restart costs more with a larger pool only where something walks the whole pool: the pin
(``cudaHostRegister``, 0.46-0.58 s per GiB of a fresh ``/dev/shm`` mapping on an H200 host; the
seed's ``l1_host_gb: 128`` x 4 ranks is one 512 GiB file that every rank pins: ~4.5 min per rank
at 0.52 s/GiB). The rank pins in the background while it serves (``rank/host_pool.py``), so a
restarted group is ready, and serves the session from L1, in the same time whatever the pool.

Here, with CPU ranks of the reference engine (``null`` model) under ``python -m deepinfer_backend
serve``:

* the large pool is ``DIB_LARGE_POOL_GB`` GiB per rank (default 2; the pool file holds that x 2
  ranks) and made resident before the turn (``posix_fallocate``: every page allocated, contents
  kept), as a pool that has been serving for a while is;
* its pin phase is stretched (the TEST ONLY knob ``DIB_HOST_POOL_PIN_S_PER_GIB``) to what the
  seed's whole 512 GiB pool would cost at 0.52 s/GiB, so the restarted ranks are still "pinning"
  it long after they are ready;
* the small pool is 0.05 GiB per rank, pinned at 0.52 s/GiB of its own size.

Both backends run at once and their ranks are killed in turn (small, large, small, ...), so the
two medians see the same machine. Not shown here: a real ``cudaHostRegister`` (no GPU), which is
the same phase on the same thread. Slow-marked (two backends, the large pool held in RAM):

    DIB_LARGE_POOL_GB=2 pytest -m slow -s tests/e2e/test_restart_large_pool.py
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.e2e_harness import Backend
from tests.e2e.test_warm_restart import _first_turn, _next_turn, _wait_restarted

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

H200_PIN_S_PER_GIB = 0.52  # cudaHostRegister of a fresh /dev/shm mapping, H200 host (0.46-0.58)
SEED_POOL_GIB = 512.0  # l1_host_gb 128 x 4 ranks: the file every rank pins
SMALL_POOL_GB = 0.05
RANKS = 2
ROUNDS = 3


def _large_pool_gb() -> float:
    raw = os.environ.get("DIB_LARGE_POOL_GB", "2")
    try:
        return float(raw)
    except ValueError:
        pytest.fail(f"DIB_LARGE_POOL_GB must be a number of GiB per rank, got {raw!r}")



@dataclass
class Pool:
    name: str
    backend: Backend
    history: list[dict[str, str]]
    pool_gib: float  # the pool file's size
    resident_gib: float  # of it, in RAM
    pin_phase_s: float  # what each rank's pin phase costs (the knob's stretch)
    ready_s: list[float] = field(default_factory=list)  # rank SIGKILL -> the group ready again
    shares: list[float] = field(default_factory=list)  # the next turn's cached share
    still_pinning: list[bool] = field(default_factory=list)  # no new rank had pinned by the answer


def _start(backends: list[Backend], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
           gb_per_rank: float, pin_s_per_gib: float, seed: int) -> Pool:
    monkeypatch.setenv("DIB_HOST_POOL_PIN_S_PER_GIB", str(pin_s_per_gib))  # read by the ranks it starts
    script = tmp_path / "unused-script.txt"
    script.write_text("")
    config = {"engine": "reference", "reference_model": "null", "block_size": 16,
              "reference_num_blocks": 2048, "max_model_len": 3800, "max_num_batched_tokens": 4096,
              "l1_host_gb": gb_per_rank}
    backend = Backend.start(script, ranks=RANKS, config=config, timeout_s=300)
    backends.append(backend)
    (path,) = Path("/dev/shm").glob(f"dib-l1-g{backend.proc.pid}-*")
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)  # allocates the holes; the data is kept
        size, resident = os.fstat(fd).st_size / (1 << 30), os.fstat(fd).st_blocks * 512 / (1 << 30)
    finally:
        os.close(fd)
    history, _, _ = _first_turn(backend, seed=seed)
    return Pool(name, backend, history, size, resident, pin_s_per_gib * size)


def _kill_and_serve(pool: Pool) -> None:
    backend = pool.backend
    pids = backend.rank_pids()
    offset = len(backend.log_text())  # what the restarted epoch logs comes after this
    killed_at = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    _wait_restarted(backend, pids)
    pool.ready_s.append(time.monotonic() - killed_at)
    usage, _ = _next_turn(backend, pool.history)
    after = backend.log_text()[offset:]
    assert after.count("pinning in the background") == RANKS, after[-3000:]
    pool.shares.append(usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"])
    pool.still_pinning.append(not re.search(r"pinned in [\d.]+ s", after))


def test_time_to_ready_after_a_rank_kill_does_not_grow_with_the_pool(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backends: list[Backend]) -> None:
    large_gb = _large_pool_gb()
    need = large_gb * RANKS * 1.5
    free = shutil.disk_usage("/dev/shm").free / (1 << 30)
    if free < need:
        pytest.skip(f"/dev/shm has {free:.1f} GiB free; the large pool needs {need:.1f} (DIB_LARGE_POOL_GB)")
    small = _start(backends, tmp_path, monkeypatch, "small", SMALL_POOL_GB, H200_PIN_S_PER_GIB, seed=41)
    # The large pool's pin phase lasts as long as the seed's 512 GiB pool's would on the H200 host.
    large = _start(backends, tmp_path, monkeypatch, "large", large_gb,
                   H200_PIN_S_PER_GIB * SEED_POOL_GIB / (large_gb * RANKS), seed=42)
    time.sleep(2.0)
    for _ in range(ROUNDS):  # interleaved: small, large, small, large, ...
        for pool in (small, large):
            _kill_and_serve(pool)
    print(f"\nload average {os.getloadavg()[0]:.1f}; {ROUNDS} rank SIGKILLs per pool, interleaved")
    for pool in (small, large):
        print(f"{pool.name} pool {pool.pool_gib:.2f} GiB ({pool.resident_gib:.2f} GiB resident), pin phase "
              f"{pool.pin_phase_s:.1f} s per rank: ready after the kill in median "
              f"{statistics.median(pool.ready_s):.1f} s ({', '.join(f'{s:.1f}' for s in pool.ready_s)}); "
              f"next turn cached {', '.join(f'{s:.1%}' for s in pool.shares)}; still pinning when it "
              f"answered: {sum(pool.still_pinning)} of {ROUNDS}")
    print(f"with the pin before ready, each large-pool restart would take {large.pin_phase_s:.0f} s more "
          f"(the seed's 512 GiB at {H200_PIN_S_PER_GIB} s/GiB)")
    for pool in (small, large):
        assert min(pool.shares) >= 0.9, pool
    assert large.resident_gib >= 0.99 * large.pool_gib
    assert all(large.still_pinning), "the large pool's pin phase ended before a next turn: nothing shown"
