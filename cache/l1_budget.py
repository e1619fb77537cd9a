"""How big the shared L1 host pool may be: the configured size, lowered to what RAM can spare.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

log = logging.getLogger(__name__)

GIB = 1 << 30


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
