"""L2 for the runtime: the disk store the cache spills KV to, built once the rank group is up.

``l2_dir`` + ``l2_gb`` > 0 turn it on (``<l2_dir>/kv``, bounded by ``l2_gb``, lowered to what
the disk has free: ``cache/l2_store.py``). It needs the L1 host pool: the store moves blocks
between the pool's slots (the ``/dev/shm`` file the ranks map, mapped here too) and disk. The
index is rebuilt from the files at start, so a new backend process with the same ``l2_dir``
restores the sessions an earlier one spilled; the stamp keeps another model's or another
layout's KV out.

``l3`` turns on the tier shared by every worker (``cache/l3_store.py``, Mooncake Store): it needs
the same host pool, and goes below L2 (``cache/l3_stack.py``) or, without L2, straight below L1.
Mooncake's package is imported only then; without it L3 stays off with a log line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from typing import TYPE_CHECKING

from cache.hashing import ChainHasher
from cache.host_slots import HostSlots
from cache.kv_tier import KVTier
from cache.l2_format import L2Stamp
from cache.l2_store import L2Store
from server.config import WorkloadConfig
from server.persist import derived_key, state_key

if TYPE_CHECKING:
    from cache.l3_store import L3Store
    from rank.client import RankClient

log = logging.getLogger(__name__)

GIB = 1 << 30


def kv_layout(config: WorkloadConfig) -> str:
    """What a KV row means besides the model name and geometry: the engine's weights and dtype.
    Equal strings <=> interchangeable bytes (with equal ``hash_salt``, block size and row size)."""
    if config.engine == "reference":
        dtype = "float32" if not config.reference_device.startswith("cuda") else "bfloat16"
        weights = config.reference_weights or "seeded-random"
        return f"reference:{config.reference_model}:{dtype}:{weights}"
    model_dir = config.resolved_model_dir()
    return f"{config.engine}:{model_dir if model_dir is not None else '-'}"


def l2_off_reason(config: WorkloadConfig, group: RankClient) -> str | None:
    if not config.l2_dir or config.l2_gb <= 0:
        return "l2_dir unset or l2_gb 0"
    if not (config.prefix_cache and config.l1_cache):
        return "it needs prefix_cache and l1_cache"
    if not group.host_pool_path or group.num_host_slots <= 0 or group.bytes_per_block <= 0:
        return "the rank group has no L1 host pool to move blocks through"
    return None


def _stamp(config: WorkloadConfig, group: RankClient, hash_salt: str) -> L2Stamp:
    return L2Stamp(hash_salt, group.block_size, group.bytes_per_block, kv_layout(config))


async def open_l2(config: WorkloadConfig, group: RankClient, hash_salt: str) -> L2Store | None:
    """The L2 store over ``group``'s host pool, its index rebuilt from ``<l2_dir>/kv`` (in a
    thread: one header read per file). None, with a log line, when L2 is off."""
    reason = l2_off_reason(config, group)
    if reason is not None:
        if config.l2_dir and config.l2_gb > 0:
            log.warning("L2 (KV on disk) off: %s", reason)
        return None
    assert config.l2_dir is not None and group.host_pool_path is not None
    host = HostSlots.map_file(group.host_pool_path, group.bytes_per_block, group.num_host_slots)
    stamp = _stamp(config, group, hash_salt)
    header_key = derived_key(await asyncio.to_thread(state_key, config.l2_dir), "kv extent headers")
    store = L2Store(os.path.join(config.l2_dir, "kv"), int(config.l2_gb * GIB), stamp, host,
                    header_key=header_key)
    await asyncio.to_thread(store.open)
    return store


def l2_gauges(store: L2Store) -> dict[str, float]:
    """The store's state for ``/metrics`` (``deepinfer_cache_l2_*``, read at scrape time): bytes
    on disk against the bound in force (``l2_gb``, lowered when the disk fills), and the counters
    of what was saved, loaded, evicted, rejected or failed (``cache.l2_store.L2Counters``)."""
    index = store.index
    gauges = {"l2_used_bytes": float(index.used_bytes), "l2_bound_bytes": float(index.max_bytes),
              "l2_max_bytes": float(store.max_bytes), "l2_extents": float(len(index.extents)),
              "l2_blocks": float(index.num_blocks)}
    for field in dataclasses.fields(store.counters):
        gauges[f"l2_{field.name}"] = float(getattr(store.counters, field.name))
    return gauges


async def open_l3(config: WorkloadConfig, group: RankClient, hash_salt: str) -> L3Store | None:
    """The L3 store over ``group``'s host pool, connected to the master (a failure to connect
    leaves it off until its next try, never the backend). None, with a log line, when L3 is off."""
    if config.l3 is None:
        return None
    from cache.l3_client import MooncakeKV, MooncakeSettings, mooncake_available
    from cache.l3_store import L3Store

    reason = l2_off_reason(config.model_copy(update={"l2_dir": "-", "l2_gb": 1.0}), group)
    missing = mooncake_available()
    if reason is not None or missing is not None:
        why = reason or f"Mooncake's client cannot be imported ({missing}); install it: scripts/setup_l3.sh"
        log.warning("L3 (shared KV store) off: %s", why)
        return None
    assert group.host_pool_path is not None
    cfg = config.l3
    settings = MooncakeSettings(master=cfg.master, bind_host=cfg.bind_host,
                                segment_bytes=int(cfg.segment_gb * GIB), protocol=cfg.protocol,
                                rdma_devices=cfg.rdma_devices)
    host = HostSlots.map_file(group.host_pool_path, group.bytes_per_block, group.num_host_slots)
    root = ChainHasher(group.block_size, hash_salt.encode()).root
    stamp = _stamp(config, group, hash_salt)
    store = L3Store(functools.partial(MooncakeKV.connect, settings), stamp, host, root,
                    staging_bytes=cfg.buffer_mb << 20, call_timeout_s=cfg.timeout_secs,
                    probe_timeout_s=cfg.probe_timeout_secs, retry_s=cfg.retry_secs,
                    prefill_tokens_per_s=cfg.prefill_tokens_per_sec)
    if await store.start():
        log.info("L3 (shared KV store) on: master %s, this worker lends %.1f GiB, client on %s",
                 cfg.master, cfg.segment_gb, cfg.bind_host)
    return store


def tier_below_l1(l2: L2Store | None, l3: L3Store | None) -> KVTier | None:
    """What L1 spills to and fills from: L2, L3, or both stacked (``cache/l3_stack.py``)."""
    if l3 is None:
        return l2
    from cache.l3_stack import StackedTier

    return StackedTier(l2, l3)


def l3_gauges(store: L3Store) -> dict[str, float]:
    """``deepinfer_cache_l3_*`` for ``/metrics``: whether L3 is on (``l3_up``; off for
    ``retry_secs`` after a failure, ``l3_outages`` counts those), the blocks this worker knows the
    store holds, the bandwidth and latency it measured, and ``cache.l3_store.L3Counters``."""
    gauges = {"l3_up": float(store.up), "l3_known_blocks": float(store.known_blocks),
              "l3_bytes_per_second": store.bytes_per_s, "l3_latency_seconds": store.latency_s}
    for field in dataclasses.fields(store.counters):
        gauges[f"l3_{field.name}"] = float(getattr(store.counters, field.name))
    return gauges
