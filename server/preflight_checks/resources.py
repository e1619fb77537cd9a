"""Host RAM (and the L1 budget it allows) and free disk.

The L1 rule itself lives in ``rank/host_budget.py`` (the cache applies it when it allocates the
shared host pool, after the ranks are up): ``pool = min(l1_host_gb x ranks, available - margin)``
with ``margin = max(8 GiB, 10 % of total RAM)``. Preflight runs *before* the ranks start, so it
predicts the RAM available at allocation time by taking off what the ranks will use on the
host, then applies that same function; it also caps the pool at what ``/dev/shm`` can hold (the
pool is a shared-memory mapping every rank maps), which RAM alone does not show.

Engine host memory per rank: DeepInfer pins an 8 GB multimodal pool per rank unless
``DEEPINFER_USE_MULTIMODAL_POOL=0`` (the ``deepinfer==0.1.0`` sdist, ``docs/deepinfer.md``) plus an estimated
12 GiB for torch, the CUDA context and graphs; the reference engine about 2 GiB.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Protocol

from rank.host_budget import plan_l1_budget as cache_plan_l1_budget
from server.preflight_checks.context import GIB, MIB, env_flag_off, gib
from server.preflight_checks.probe import MemoryInfo
from server.preflight_checks.report import CheckResult, ok, warn

DEEPINFER_MM_POOL_BYTES = 8 * 10**9
DEEPINFER_PROCESS_BYTES = 12 * GIB
REFERENCE_PROCESS_BYTES = 2 * GIB
SHM_MARGIN_BYTES = 1 * GIB
MIN_FREE_DISK_BYTES = 20 * GIB  # JIT kernel caches, logs, core dumps
# A logger attached to nothing: the cache's rule logs its decision at INFO, which for a
# prediction would read like the real allocation.
_QUIET = logging.Logger("preflight.l1_prediction", level=logging.WARNING)


class L1Settings(Protocol):
    """The config keys the rule reads (``WorkloadConfig`` has them all; read-only here)."""

    @property
    def engine(self) -> str: ...
    @property
    def ep(self) -> int: ...
    @property
    def l1_cache(self) -> bool: ...
    @property
    def l1_host_gb(self) -> float: ...
    @property
    def deepinfer_env(self) -> dict[str, str]: ...


@dataclass(slots=True, frozen=True)
class L1BudgetPlan:
    """Invariant: ``granted_total_bytes <= requested_total_bytes``, and ``<= shm_free_bytes`` when known."""

    num_ranks: int
    requested_total_bytes: int
    available_bytes: int  # as measured now (before the ranks start, unless engine_running)
    reserve_bytes: int  # engine host memory still to come + the cache's margin
    shm_free_bytes: int | None
    granted_total_bytes: int
    limited_by: str  # "request", "ram", "shm", "disabled"
    reason: str

    @property
    def granted_per_rank_bytes(self) -> int:
        return self.granted_total_bytes // self.num_ranks


def engine_host_bytes_per_rank(config: L1Settings) -> int:
    if config.engine != "deepinfer":
        return REFERENCE_PROCESS_BYTES
    mm_pool = 0 if env_flag_off(config.deepinfer_env,
                                "DEEPINFER_USE_MULTIMODAL_POOL") else DEEPINFER_MM_POOL_BYTES
    return mm_pool + DEEPINFER_PROCESS_BYTES


def plan_l1_budget(
    config: L1Settings, available_bytes: int, *, total_bytes: int | None = None,
    shm_free_bytes: int | None = None, engine_running: bool = False,
) -> L1BudgetPlan:
    """What L1 will get, and why (the cache's rule on the RAM left once the ranks run).

    ``engine_running``: the ranks are already up, so their host memory is already out of
    ``available_bytes``. ``total_bytes`` (for the cache's 10 % margin) defaults to ``available_bytes``.
    """
    ranks = config.ep
    engine = 0 if engine_running else engine_host_bytes_per_rank(config) * ranks
    at_alloc = max(0, available_bytes - engine)
    total = total_bytes if total_bytes is not None else available_bytes
    budget = cache_plan_l1_budget(
        l1_cache=config.l1_cache, l1_host_gb=config.l1_host_gb, num_ranks=ranks, bytes_per_block=MIB,
        virtual_memory=lambda: SimpleNamespace(available=at_alloc, total=total), logger=_QUIET,
    )
    requested = budget.requested_bytes if config.l1_cache else 0
    granted, reason = budget.pool_bytes, budget.reason
    if not config.l1_cache or requested == 0:
        limited_by = "disabled"
    elif granted >= requested:
        limited_by = "request"
    else:
        limited_by = "ram"
    if engine and limited_by != "disabled":
        reason += f" (after about {gib(engine)} for the ranks themselves)"
    if (limited_by != "disabled" and shm_free_bytes is not None
            and granted > shm_free_bytes - SHM_MARGIN_BYTES):
        granted = max(0, shm_free_bytes - SHM_MARGIN_BYTES) // MIB * MIB
        limited_by = "shm"
        reason = f"/dev/shm has {gib(shm_free_bytes)} free, so the shared pool gets {gib(granted)}"
    if limited_by != "disabled" and granted == 0 and not reason.startswith("L1 off"):
        reason = f"L1 off: {reason}"
    return L1BudgetPlan(ranks, requested, available_bytes, engine + budget.margin_bytes, shm_free_bytes,
                        granted, limited_by, reason)


def l1_budget_bytes(
    config: L1Settings, available_bytes: int, *, total_bytes: int | None = None,
    shm_free_bytes: int | None = None, engine_running: bool = False,
) -> int:
    """Total pinned host bytes of the shared L1 pool over all ranks (0 = L1 off); see the module doc."""
    return plan_l1_budget(
        config, available_bytes, total_bytes=total_bytes, shm_free_bytes=shm_free_bytes,
        engine_running=engine_running,
    ).granted_total_bytes


def check_host_ram(config: L1Settings, memory: MemoryInfo, shm_free_bytes: int | None) -> CheckResult:
    name = "host_ram"
    usable = memory.usable_bytes
    plan = plan_l1_budget(config, usable, total_bytes=memory.total_bytes, shm_free_bytes=shm_free_bytes)
    limit = f", container limit {gib(memory.cgroup_limit_bytes)}" if memory.cgroup_limit_bytes else ""
    seen = f"{gib(usable)} available of {gib(memory.total_bytes)}{limit}"
    data = {
        "available_bytes": usable, "total_bytes": memory.total_bytes,
        "cgroup_limit_bytes": memory.cgroup_limit_bytes, "shm_free_bytes": shm_free_bytes,
        "l1_requested_bytes": plan.requested_total_bytes, "l1_granted_bytes": plan.granted_total_bytes,
        "l1_granted_per_rank_bytes": plan.granted_per_rank_bytes, "reserve_bytes": plan.reserve_bytes,
        "l1_limited_by": plan.limited_by,
    }
    engine = engine_host_bytes_per_rank(config) * config.ep
    if usable < engine:
        return warn(
            name, f"{seen}; the {config.ep} ranks alone need about {gib(engine)} of host RAM",
            "Free host RAM or use a machine with more of it; the ranks may be killed for memory.", **data,
        )
    if plan.limited_by in ("request", "disabled"):
        l1 = "L1 off by config"
        if plan.limited_by != "disabled":
            per_rank = gib(plan.granted_per_rank_bytes)
            l1 = f"L1 gets {gib(plan.granted_total_bytes)} ({per_rank} x {config.ep} ranks)"
        return ok(name, f"{seen}; {l1}", **data)
    fix = (
        f"Lower l1_host_gb to {plan.granted_per_rank_bytes / GIB:.1f} or less to make the budget explicit, "
           "or give the machine more RAM." if plan.limited_by == "ram" else
           "Enlarge /dev/shm (e.g. docker --shm-size or a bigger tmpfs) or lower l1_host_gb.")
    if plan.granted_per_rank_bytes == 0:
        fix = "Run with l1_cache false (L0 only), or free RAM / enlarge /dev/shm for the pinned pool."
    return warn(name, f"{seen}; L1 {plan.reason}", fix, **data)


def check_disk(paths: Mapping[str, Path], free_bytes: Mapping[str, int | None]) -> CheckResult:
    """``paths``: label -> path; ``free_bytes``: label -> free bytes (None when unknown)."""
    name = "disk"
    parts, low = [], []
    for label, path in paths.items():
        free = free_bytes.get(label)
        if free is None:
            parts.append(f"{label} {path}: unknown")
            continue
        parts.append(f"{label} {path}: {gib(free)} free")
        if free < MIN_FREE_DISK_BYTES:
            low.append(f"{label} ({gib(free)})")
    data = {"free_bytes": {k: v for k, v in free_bytes.items()},
            "paths": {k: str(v) for k, v in paths.items()}}
    if low:
        return warn(
            name, "; ".join(parts), f"Free at least {gib(MIN_FREE_DISK_BYTES)} on {', '.join(low)} for "
            "the JIT kernel caches and logs.", **data,
        )
    return ok(name, "; ".join(parts), **data)
