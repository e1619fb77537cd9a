"""How big the shared L1 host pool may be, and where it lives (no torch: the backend process
and the preflight import this; the ranks map the pool with ``rank/host_pool.py``).

The size is the configured one, lowered to what RAM can spare.

``l1_host_gb`` is per rank (the seed guide's meaning); the pool is shared by all ranks, so the
request is ``l1_host_gb * num_ranks``. The machine must keep room for everything else: the
budget is at most ``available RAM - margin``, where ``margin = max(min_margin, fraction *
total RAM)`` (defaults 8 GiB and 10%: the rank processes' own host memory, the backend's
tokenizer caches and page cache for the weights). The pool is pinned (cudaHostRegister), so
overcommitting it would not be swapped out but would get the processes OOM-killed.

The result is logged once with the reason, e.g. ``L1 host pool: 96.0 GiB (requested 512.0 GiB
= 128.0 GiB x 4 ranks; lowered: 104.0 GiB available - 8.0 GiB margin)``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

log = logging.getLogger(__name__)

GIB = 1 << 30
SHM_DIR = "/dev/shm"


@dataclass(frozen=True, slots=True)
class L1Budget:
    num_slots: int  # host slots of bytes_per_block each (0: L1 off)
    pool_bytes: int
    requested_bytes: int
    available_bytes: int
    margin_bytes: int
    reason: str

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0


def plan_l1_budget(
    *,
    l1_cache: bool,
    l1_host_gb: float,
    num_ranks: int,
    bytes_per_block: int,
    virtual_memory: Callable[[], Any] = psutil.virtual_memory,
    min_margin_bytes: int = 8 * GIB,
    margin_fraction: float = 0.10,
    logger: logging.Logger | None = None,
) -> L1Budget:
    """Decide the pool size (``virtual_memory`` is injectable so tests can fake a small box)."""
    logger = logger or log
    requested = int(l1_host_gb * GIB) * num_ranks
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    vm = virtual_memory()
    available = int(vm.available)
    margin = max(min_margin_bytes, int(margin_fraction * int(vm.total)))
    spare = max(0, available - margin)
    if not l1_cache or requested == 0:
        why = "l1_cache is false" if not l1_cache else "l1_host_gb is 0"
        budget = L1Budget(0, 0, requested, available, margin, f"L1 off: {why}")
    else:
        pool = min(requested, spare)
        slots = pool // bytes_per_block
        asked = f"requested {requested / GIB:.1f} GiB = {l1_host_gb:g} GiB x {num_ranks} ranks"
        if pool < requested:
            reason = (
                f"{asked}; lowered: {available / GIB:.1f} GiB available - {margin / GIB:.1f} GiB margin"
            )
        else:
            reason = f"{asked}; {available / GIB:.1f} GiB available, {margin / GIB:.1f} GiB margin kept"
        if slots == 0:
            reason = f"L1 off: no RAM to spare ({reason})"
        budget = L1Budget(int(slots), int(slots * bytes_per_block), requested, available, margin, reason)
    logger.info(
        "L1 host pool: %.1f GiB, %d slots of %d B (%s)",
        budget.pool_bytes / GIB,
        budget.num_slots,
        bytes_per_block,
        budget.reason,
    )
    return budget


def host_pool_path(group_name: str, shm_dir: str = SHM_DIR) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", group_name)
    return os.path.join(shm_dir, f"dib-l1-{safe}")


def plan_host_pool_bytes(l1_host_gb: float, num_ranks: int, shm_dir: str = SHM_DIR) -> tuple[int, str]:
    """The shared pool's size: ``l1_host_gb`` per rank, lowered to what the machine can spare.

    Returns (bytes, reason). The RAM rule is ``plan_l1_budget``'s (available RAM minus a safety
    margin), so the pool the ranks map, the L1 index and the preflight report agree. On top of it
    the pool must fit in 90% of ``shm_dir``'s free space: the pool is a tmpfs file, and writing
    past the filesystem kills the writer with SIGBUS.
    """
    budget = plan_l1_budget(l1_cache=True, l1_host_gb=l1_host_gb, num_ranks=num_ranks, bytes_per_block=1)
    stat = os.statvfs(shm_dir)
    shm_free = int(stat.f_bavail * stat.f_frsize * 0.9)
    pool_bytes = min(budget.pool_bytes, shm_free)
    reason = (f"L1 host pool {pool_bytes / GIB:.2f} GiB ({budget.reason}; {shm_dir} allows "
              f"{shm_free / GIB:.2f} GiB)")
    return pool_bytes, reason


def unlink_host_pool(path: str) -> None:
    """Remove the pool file (the group stops or restarts; a missing file is fine)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
