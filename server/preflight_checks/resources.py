"""Host RAM (and the L1 budget it allows) and free disk.

``plan_l1_budget`` / ``l1_budget_bytes`` is THE rule for how much pinned host RAM L1 gets; the
backend computes it once and hands the result to the cache (cache/ must not import server/).

Rule: L1 may take what is available minus a reserve, never more than ``l1_host_gb`` x ranks,
never more than ``/dev/shm`` can hold (the pool is a shared-memory mapping every rank maps):

    reserve   = engine host memory per rank x ranks   (unless the engine is already running)
              + max(8 GiB, 5 % of available)           (backend process, page cache, the OS)
    granted   = min(l1_host_gb x ranks, available - reserve, shm_free - 1 GiB)
    per rank  = granted / ranks, rounded down to 1 MiB; below 1 GiB per rank L1 is off (0).

Engine host memory per rank: DeepInfer pins an 8 GB multimodal pool per rank unless
``DEEPINFER_USE_MULTIMODAL_POOL=0`` (reference/deepinfer-engine.md section 9) plus an estimated
12 GiB for torch, the CUDA context and graphs; the reference engine about 2 GiB.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from server.preflight_checks.context import GIB, MIB, env_flag_off, gib
from server.preflight_checks.probe import MemoryInfo
from server.preflight_checks.report import CheckResult, ok, warn

DEEPINFER_MM_POOL_BYTES = 8 * 10**9
DEEPINFER_PROCESS_BYTES = 12 * GIB
REFERENCE_PROCESS_BYTES = 2 * GIB
SYSTEM_RESERVE_MIN_BYTES = 8 * GIB
SYSTEM_RESERVE_FRACTION = 0.05
SHM_MARGIN_BYTES = 1 * GIB
MIN_L1_PER_RANK_BYTES = 1 * GIB
MIN_FREE_DISK_BYTES = 20 * GIB  # JIT kernel caches, logs, core dumps


class L1Settings(Protocol):
    """The config keys the rule reads (``WorkloadConfig`` has them all)."""

    engine: str
    ep: int
    l1_cache: bool
    l1_host_gb: float
    deepinfer_env: dict[str, str]


@dataclass(slots=True, frozen=True)
class L1BudgetPlan:
    """Invariant: ``granted_total_bytes == granted_per_rank_bytes * num_ranks <= requested_total_bytes``."""

    num_ranks: int
    requested_total_bytes: int
    available_bytes: int
    reserve_bytes: int
    shm_free_bytes: int | None
    granted_per_rank_bytes: int
    limited_by: str  # "request", "ram", "shm", "disabled"
    reason: str

    @property
    def granted_total_bytes(self) -> int:
        return self.granted_per_rank_bytes * self.num_ranks


def engine_host_bytes_per_rank(config: L1Settings) -> int:
    if config.engine != "deepinfer":
        return REFERENCE_PROCESS_BYTES
    mm_pool = 0 if env_flag_off(config.deepinfer_env, "DEEPINFER_USE_MULTIMODAL_POOL") else DEEPINFER_MM_POOL_BYTES
    return mm_pool + DEEPINFER_PROCESS_BYTES


def plan_l1_budget(
    config: L1Settings, available_bytes: int, *, shm_free_bytes: int | None = None,
    engine_running: bool = False,
) -> L1BudgetPlan:
    """How much pinned host RAM L1 gets, and why. ``engine_running``: the ranks are already up,
    so their host memory is already out of ``available_bytes`` and is not reserved again."""
    ranks = config.ep
    requested = int(config.l1_host_gb * GIB) * ranks if config.l1_cache else 0
    engine = 0 if engine_running else engine_host_bytes_per_rank(config) * ranks
    reserve = engine + max(SYSTEM_RESERVE_MIN_BYTES, int(SYSTEM_RESERVE_FRACTION * available_bytes))

    def plan(per_rank: int, limited_by: str, reason: str) -> L1BudgetPlan:
        return L1BudgetPlan(ranks, requested, available_bytes, reserve, shm_free_bytes, per_rank, limited_by, reason)

    if not config.l1_cache or requested == 0:
        return plan(0, "disabled", "l1_cache is off" if not config.l1_cache else "l1_host_gb is 0")
    candidates = [(requested, "request"), (max(0, available_bytes - reserve), "ram")]
    if shm_free_bytes is not None:
        candidates.append((max(0, shm_free_bytes - SHM_MARGIN_BYTES), "shm"))
    total, limited_by = min(candidates, key=lambda c: c[0])
    per_rank = total // ranks // MIB * MIB
    if limited_by == "request":
        return plan(per_rank, "request", f"{config.l1_host_gb:g} GiB per rank as configured")
    why = (f"{gib(available_bytes)} available minus {gib(reserve)} reserved for the engine and system"
           if limited_by == "ram" else f"/dev/shm has {gib(shm_free_bytes or 0)} free")
    if per_rank < MIN_L1_PER_RANK_BYTES:
        return plan(0, limited_by, f"L1 off: {why} leaves under {gib(MIN_L1_PER_RANK_BYTES)} per rank")
    return plan(per_rank, limited_by, f"lowered to {gib(per_rank)} per rank: {why}")


def l1_budget_bytes(
    config: L1Settings, available_bytes: int, *, shm_free_bytes: int | None = None,
    engine_running: bool = False,
) -> int:
    """Total pinned host bytes for the L1 pool over all ranks (0 = L1 off); see the module doc."""
    return plan_l1_budget(
        config, available_bytes, shm_free_bytes=shm_free_bytes, engine_running=engine_running
    ).granted_total_bytes


def check_host_ram(config: L1Settings, memory: MemoryInfo, shm_free_bytes: int | None) -> CheckResult:
    name = "host_ram"
    usable = memory.usable_bytes
    plan = plan_l1_budget(config, usable, shm_free_bytes=shm_free_bytes)
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
        l1 = "L1 off by config" if plan.limited_by == "disabled" else \
            f"L1 gets {gib(plan.granted_total_bytes)} ({gib(plan.granted_per_rank_bytes)} x {config.ep} ranks)"
        return ok(name, f"{seen}; {l1}", **data)
    asked = f"l1_host_gb {config.l1_host_gb:g} x {config.ep} ranks = {gib(plan.requested_total_bytes)}"
    fix = (f"Lower l1_host_gb to {plan.granted_per_rank_bytes / GIB:.1f} or less to make the budget explicit, "
           "or give the machine more RAM." if plan.limited_by == "ram" else
           "Enlarge /dev/shm (e.g. docker --shm-size or a bigger tmpfs) or lower l1_host_gb.")
    if plan.granted_per_rank_bytes == 0:
        fix = "Run with l1_cache false (L0 only), or free RAM / enlarge /dev/shm for the pinned pool."
    return warn(name, f"{seen}; {asked} asked; {plan.reason}", fix, **data)


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
    data = {"free_bytes": {k: v for k, v in free_bytes.items()}, "paths": {k: str(v) for k, v in paths.items()}}
    if low:
        return warn(
            name, "; ".join(parts), f"Free at least {gib(MIN_FREE_DISK_BYTES)} on {', '.join(low)} for "
            "the JIT kernel caches and logs.", **data,
        )
    return ok(name, "; ".join(parts), **data)
