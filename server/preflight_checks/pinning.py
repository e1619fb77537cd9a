"""The pinned L1 pool against the machine: ``/dev/shm`` size and the memlock limit.

L1 is one file in ``/dev/shm`` (tmpfs) of ``l1_host_gb x ranks`` (``rank/host_budget.py``), which
every rank process maps whole and, on CUDA, registers with ``cudaHostRegister`` so copies are DMA
(``rank/host_pool.py``). So the pool needs a ``/dev/shm`` that large: the backend caps the pool
at 90% of its free space (writing past a tmpfs kills the writer with SIGBUS), and a container's
default 64 MiB ``/dev/shm`` leaves L1 next to nothing. And each rank locks the pool's pages
into RAM: a memlock limit (RLIMIT_MEMLOCK) below the pool may make the registration fail or be
refused, so the check asks for a limit of at least the pool (unlimited is simplest). Pinning
costs time too, about 0.5 s per GiB per rank (0.46-0.58 s measured on an H200 host for 4-48
GiB), given in the data as ``pin_estimate_s``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.preflight_checks.context import GIB, gib, human_bytes, uses_gpu
from server.preflight_checks.probe import ShmInfo
from server.preflight_checks.report import CheckResult, ok, skipped, warn

if TYPE_CHECKING:
    from server.config import WorkloadConfig

SHM_PATH = "/dev/shm"
SHM_USABLE_FRACTION = 0.9  # rank/host_budget.plan_host_pool_bytes keeps 10% of the tmpfs free
PIN_SECONDS_PER_GIB = 0.5


def l1_pool_bytes(config: WorkloadConfig) -> int:
    """The shared pool the config asks for, all ranks together (0 when L1 is off)."""
    if not config.l1_cache:
        return 0
    return int(config.l1_host_gb * GIB) * config.ep


def check_shm(config: WorkloadConfig, shm: ShmInfo | None) -> CheckResult:
    name = "shm"
    pool = l1_pool_bytes(config)
    if pool == 0:
        return skipped(name, "L1 is off (l1_cache false or l1_host_gb 0): nothing in /dev/shm")
    asked = f"the L1 pool of {gib(pool)} ({config.l1_host_gb:g} GiB x {config.ep} ranks)"
    if shm is None:
        return warn(name, f"{SHM_PATH} does not exist: {asked} cannot be created and L1 will be off",
                    f"Mount a tmpfs on {SHM_PATH} at least {gib(pool / SHM_USABLE_FRACTION)} large.",
                    requested_bytes=pool)
    usable = int(shm.free_bytes * SHM_USABLE_FRACTION)
    data = {"requested_bytes": pool, "shm_total_bytes": shm.total_bytes, "shm_free_bytes": shm.free_bytes,
            "usable_bytes": usable}
    seen = f"{SHM_PATH} is {gib(shm.total_bytes)} ({gib(shm.free_bytes)} free)"
    if usable >= pool:
        return ok(name, f"{seen}: holds {asked}", **data)
    need = gib(pool / SHM_USABLE_FRACTION + (shm.total_bytes - shm.free_bytes))
    return warn(
        name, f"{seen}: {asked} does not fit, L1 will be cut to {gib(usable)} (90% of the free space)",
        f"Enlarge {SHM_PATH} to at least {need} (docker run --shm-size, or mount -o remount,size=... "
        f"{SHM_PATH}), or lower l1_host_gb to {usable / config.ep / GIB:.1f} to make the size explicit.",
        **data,
    )


def check_memlock(config: WorkloadConfig, limits: tuple[int | None, int | None]) -> CheckResult:
    name = "memlock"
    pool = l1_pool_bytes(config)
    soft, hard = limits
    data = {"memlock_soft_bytes": soft, "memlock_hard_bytes": hard, "pinned_per_rank_bytes": pool,
            "pin_estimate_s": round(pool / GIB * PIN_SECONDS_PER_GIB, 1)}
    if pool == 0:
        return skipped(name, "L1 is off: nothing is pinned", **data)
    if not uses_gpu(config):
        return skipped(name, f"engine '{config.engine}' runs on cpu: the L1 pool is not pinned", **data)
    per_rank = f"each rank pins the whole {gib(pool)} pool (cudaHostRegister)"
    estimate = f"about {data['pin_estimate_s']:g} s per rank at {PIN_SECONDS_PER_GIB:g} s/GiB"
    if soft is None:
        return ok(name, f"memlock unlimited; {per_rank}, {estimate}", **data)
    limit = f"memlock limit {human_bytes(soft)} (hard {'unlimited' if hard is None else human_bytes(hard)})"
    if soft >= pool:
        return ok(name, f"{limit}; {per_rank}, {estimate}", **data)
    return warn(
        name, f"{limit} is below the pinned pool: {per_rank}; the registration may fail or be refused",
        "Raise the worker's memlock limit to unlimited (ulimit -l unlimited; docker run --ulimit "
        "memlock=-1:-1; systemd LimitMEMLOCK=infinity), or lower l1_host_gb.", **data,
    )
