"""The rank group's run directory (rank/launch.py ``make_run_dir``): a backend killed outright
leaves its directory behind; the next backend removes it, and never one whose backend runs."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rank.launch import RUN_DIR_LOCK, RUN_DIR_PREFIX, make_run_dir

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def _held(lock: Path) -> bool:
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def test_a_dead_backends_directory_goes_a_live_ones_stays(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / f"{RUN_DIR_PREFIX}dead"
    dead.mkdir()
    (dead / RUN_DIR_LOCK).touch()  # its holder is gone
    (dead / "e1-r0-x").touch()
    old = tmp_path / f"{RUN_DIR_PREFIX}nolock"  # made before the lock existed: left alone
    old.mkdir()
    other = tmp_path / "something-else"
    other.mkdir()
    (other / RUN_DIR_LOCK).touch()
    live = tmp_path / f"{RUN_DIR_PREFIX}live"
    live.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(live / RUN_DIR_LOCK)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        path, fd = make_run_dir()
        try:
            assert not dead.exists()
            assert live.exists() and old.exists() and other.exists()
            assert Path(path).parent == tmp_path and Path(path).name.startswith(RUN_DIR_PREFIX)
            assert _held(Path(path) / RUN_DIR_LOCK)  # by this process, for as long as fd is open
            assert _held(live / RUN_DIR_LOCK)
        finally:
            os.close(fd)
        assert not _held(Path(path) / RUN_DIR_LOCK)
    finally:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.wait(10)
        holder.stdout.close()
    last, fd = make_run_dir()  # the holder is gone: now both the live one and ours are stale
    os.close(fd)
    assert not live.exists() and not Path(path).exists() and old.exists() and Path(last).exists()
