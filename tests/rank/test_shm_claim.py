"""L1 pool files of backends that are gone are removed at the next start; a live one never is
(``rank/shm_claim.py``); and when the rank group's supervisor gives up (``rank/restart_budget.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from rank.restart_budget import RestartBudget
from rank.shm_claim import claim_host_pool, reclaim_orphan_pools, release_host_pool

REPO = Path(__file__).resolve().parents[2]

_HOLDER = textwrap.dedent("""
    import os, sys, time
    from rank.shm_claim import claim_host_pool
    shm_dir, name_pid = sys.argv[1], sys.argv[2]
    path = os.path.join(shm_dir, f"dib-l1-g{name_pid or os.getpid()}-abc")
    claim_host_pool(path, 1 << 20, shm_dir)
    with open(path, "r+b") as f:
        f.truncate(1 << 20)
    print(path, flush=True)
    time.sleep(600)
""")


def _holder(shm_dir: Path, name_pid: str = "") -> tuple[subprocess.Popen[str], Path]:
    """A process that claims a pool file (named after its own pid, or ``name_pid``) and keeps it."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(shm_dir), name_pid], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def _end(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_sigkilled_owners_pool_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    killed, orphan = _holder(tmp_path)
    live, kept = _holder(tmp_path)
    try:
        assert orphan.exists() and kept.exists()
        assert reclaim_orphan_pools(str(tmp_path)) == [], "a live owner's file was taken"
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        assert orphan.exists(), "nothing removes it on its own (the failure this guards against)"
        assert reclaim_orphan_pools(str(tmp_path)) == [str(orphan)]
        assert not orphan.exists() and kept.exists()
    finally:
        for proc in (killed, live):
            _end(proc)


def test_a_locked_file_is_kept_even_when_its_pid_is_not_ours_to_see(tmp_path: Path) -> None:
    """A backend in another pid namespace: its name's pid means nothing here, its lock does."""
    holder, path = _holder(tmp_path, name_pid=str(_dead_pid()))
    try:
        assert reclaim_orphan_pools(str(tmp_path)) == []
        assert path.exists()
    finally:
        _end(holder)
    assert reclaim_orphan_pools(str(tmp_path)) == [str(path)]


def test_files_not_named_by_a_rank_group_are_left_alone(tmp_path: Path) -> None:
    dead = _dead_pid()
    others = [tmp_path / "dib-l1-local-1-x", tmp_path / f"dib-l1-bench-{dead}", tmp_path / "unrelated",
              tmp_path / f"dib-l1-g{dead}-x.new"]
    for path in others:
        path.write_bytes(b"x")
    orphan = tmp_path / f"dib-l1-g{dead}-abc"
    orphan.write_bytes(b"x")  # a backend before the lock: unlocked, its pid gone
    assert reclaim_orphan_pools(str(tmp_path)) == [str(orphan)]
    assert all(p.exists() for p in others)


def test_claim_and_release(tmp_path: Path) -> None:
    path = str(tmp_path / f"dib-l1-g{os.getpid()}-own")
    assert claim_host_pool(path, 0, str(tmp_path)) == -1 and not os.path.exists(path)
    fd = claim_host_pool(path, 1 << 20, str(tmp_path))
    assert fd >= 0 and os.path.exists(path)
    assert reclaim_orphan_pools(str(tmp_path)) == []  # our own pid, and locked
    assert release_host_pool(path, fd) == -1 and not os.path.exists(path)


def test_restart_budget() -> None:
    now = [0.0]
    budget = RestartBudget(max_start_failures=2, max_restarts=2, window_s=100.0, clock=lambda: now[0])
    assert budget.give_up(was_ready=True) is None
    now[0] = 10.0
    assert budget.give_up(was_ready=True) is None
    now[0] = 20.0
    spent = budget.give_up(was_ready=True)
    assert spent is not None and "restart budget spent: 3 failures within 100 s" in spent
    # Restarts age out of the window.
    budget = RestartBudget(max_start_failures=2, max_restarts=1, window_s=100.0, clock=lambda: now[0])
    for t in (0.0, 150.0, 300.0):
        now[0] = t
        assert budget.give_up(was_ready=True) is None
    # Failed starts count in a row; a ready epoch resets them.
    assert budget.give_up(was_ready=False) is None
    now[0] = 500.0
    assert budget.give_up(was_ready=True) is None
    assert budget.give_up(was_ready=False) is None
    assert budget.give_up(was_ready=False) == "2 failed starts in a row"
