"""Who owns an L1 host pool file in ``/dev/shm``, and removing the files whose owner is gone.

A backend killed outright (SIGKILL, the OOM killer) cannot unlink its pool file, and tmpfs keeps
the bytes in RAM: at the seed's ``l1_host_gb: 128`` x 4 ranks that is 512 GiB the next backend
then cannot have. So the supervisor (``RankGroup``) holds an exclusive ``flock`` on its pool
file for as long as it runs (``claim_host_pool``), and every start first removes the pool files
nobody holds (``reclaim_orphan_pools``), as ``rank/launch.py`` does for run directories. The
kernel drops a dead process's ``flock``, whatever its pid namespace, so a live backend's file is
never taken for an orphan. Two more guards keep files this code does not own alone: only names a
``RankGroup`` gives (``dib-l1-g<pid>-...``), and only when that pid is not a live process here
(a backend of a version before the lock holds none).

Reclaim rather than adopt: a dead backend's pool holds L1 entries whose index died with it; its
L2 files on disk hold the same sessions (every committed L1 write is spilled), and the new
backend restores from those.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re

from rank.host_budget import GIB, SHM_DIR, unlink_host_pool

log = logging.getLogger(__name__)

POOL_PREFIX = "dib-l1-"
_OWNED_NAME = re.compile(rf"^{re.escape(POOL_PREFIX)}g(\d+)-[A-Za-z0-9_.-]+$")


def claim_host_pool(path: str, pool_bytes: int, shm_dir: str = SHM_DIR) -> int:
    """A group's start: remove orphans (``reclaim_orphan_pools``) and any file at ``path``, then,
    if the pool is not empty, create the file (empty; the ranks size it) with an exclusive lock
    held on it. Returns the lock's descriptor (-1 for no pool); ``release_host_pool`` ends it.
    Locked before it takes its name, so a scan never finds it unlocked."""
    reclaim_orphan_pools(shm_dir)
    unlink_host_pool(path)
    if pool_bytes <= 0:
        return -1
    tmp = path + ".new"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release_host_pool(path: str, lock_fd: int) -> int:
    """A group's close: remove the pool file and drop its lock. Returns -1 (no lock held)."""
    unlink_host_pool(path)
    if lock_fd >= 0:
        os.close(lock_fd)
    return -1


def reclaim_orphan_pools(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove every pool file in ``shm_dir`` whose owner is gone (module docstring). Returns the
    paths removed; each is logged with its size."""
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        match = _OWNED_NAME.match(name)
        if match is None or name.endswith(".new") or _pid_alive(int(match.group(1))):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # held: its backend runs (in another pid namespace)
        try:
            size = os.fstat(fd).st_size
            os.unlink(path)
        except OSError:
            continue
        finally:
            os.close(fd)
        removed.append(path)
        log.warning("removed L1 host pool %s (%.2f GiB) left by a backend that is gone", path, size / GIB)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
