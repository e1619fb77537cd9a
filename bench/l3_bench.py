"""L3 restore next to L2 and prefill: a V4.1-Flash session's KV from the host pool to a Mooncake
Store held by another process and back, and the same through L2 on local disk.

    python -m bench.l3_bench --quick            # 8K tokens (7 MB), 1 repeat, seconds
    python -m bench.l3_bench --tokens 65536     # 58 MB, under a minute
    python -m bench.l3_bench                    # the 500K-token session (446 MB of KV)
    python -m bench.l3_bench --json out.json

Two processes, as two workers would be: a holder (a Mooncake client lending the pool its RAM, as a
worker with ``l3.segment_gb`` > 0 does) and this process, which lends none and runs the real
``L3Store`` (``cache/l3_store.py``: per-block objects with header and xxh3, staging buffers,
batched zero-copy calls) against a ``mooncake_master`` on loopback, so every byte crosses a TCP
connection between processes. Rows are DeepSeek-V4.1-Flash's 114,048 B per 128-token block; the
payload is random bytes and every restore is compared byte for byte with what was saved.

Printed per tier (median of ``--repeats``): save and restore wall time and GB/s, and for L3 the
existence query of the whole chain (``probe``, what a turn waits before it is planned). Prefill is
the node's recompute rate (``--prefill-tokens-per-s``, default 352K tokens/s: 4 H200 ranks of
V4.1-Flash, docs/tiers.md), the bar a restore must beat (``l3.prefill_tokens_per_sec``).
Nothing passes or fails on a stopwatch. Needs Mooncake's client (scripts/setup_l3.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.l2_bench import BLOCK_SIZE, V41_FLASH_BYTES_PER_BLOCK, bench_l2
from bench.support.ports import free_port
from bench.support.quick import add_quick
from cache.hashing import ChainHasher
from cache.host_slots import HostSlots
from cache.l2_format import L2Stamp
from cache.l3_client import MooncakeKV, MooncakeSettings, mooncake_available
from cache.l3_store import L3Store

GB = 1e9
_HOLDER = """
import sys, time
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[1]) == 0
print("holding", flush=True)
time.sleep(3600)
"""


def _start(args: list[str], log: Path, ready: str | None = None,
           port: int | None = None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if port is not None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return proc
            except OSError:
                pass
        if ready is not None and ready in log.read_text(errors="replace"):
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{args[0]} did not start: {log.read_text(errors='replace')[-2000:]}")


async def _l3_runs(store: L3Store, hashes: list[int], root: int, num_blocks: int, repeats: int,
                   namespace_base: str) -> list[tuple[float, float, float, bool, float]]:
    runs = []
    for r in range(repeats):
        store.namespace = f"{namespace_base}-{r}"  # fresh keys: a save that stores everything
        store._known.clear()
        started = time.perf_counter()
        saved = await store.save(hashes, root, 0)
        save_s = time.perf_counter() - started
        store._known.clear()
        store.host.array[num_blocks : 2 * num_blocks] = 0
        started = time.perf_counter()
        await store.probe(hashes)
        probe_s = time.perf_counter() - started
        started = time.perf_counter()
        loaded = await store.load(hashes, 0, num_blocks, num_blocks)
        restore_s = time.perf_counter() - started
        same = saved == loaded == num_blocks and np.array_equal(store.host.array[:num_blocks],
                                                                store.host.array[num_blocks : 2 * num_blocks])
        if not same:
            print(f"round {r}: saved {saved}, restored {loaded} of {num_blocks} blocks", file=sys.stderr)
        runs.append((save_s, probe_s, restore_s, same, _raw_get_s(store, hashes)))
    return runs


def _raw_get_s(store: L3Store, hashes: list[int]) -> float:
    """Mooncake's own batched gets of the same objects into the staging buffer, without our
    checks and copies: what the store costs by itself."""
    client = store._client
    assert client is not None
    started = time.perf_counter()
    for i in range(0, len(hashes), store.blocks_per_call):
        part = hashes[i : i + store.blocks_per_call]
        client.get_into([store._key(h) for h in part], store._addresses(1, len(part)),
                        [store.object_bytes] * len(part))
    return time.perf_counter() - started


def master_binary() -> str | None:
    """The ``mooncake_master`` executable: the one inside the installed ``mooncake`` package first
    (what the ``mooncake_master`` console script execs; that script's shebang names the venv's path
    at install time, so it breaks when the venv is reached through another path), then the
    script beside this Python, then PATH."""
    try:
        import mooncake
    except ImportError:
        packaged = None
    else:
        packaged = Path(mooncake.__file__).parent / "mooncake_master"
    beside = Path(sys.executable).parent / "mooncake_master"
    for candidate in (packaged, beside):
        if candidate is not None and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("mooncake_master")


def bench_l3(num_blocks: int, bytes_per_block: int, repeats: int, staging_mb: int) -> dict[str, Any]:
    master_bin = master_binary()
    if master_bin is None:
        raise RuntimeError("mooncake_master not found (scripts/setup_l3.sh)")
    work = Path(tempfile.mkdtemp(prefix="l3-bench-"))
    port, http_port = free_port(), free_port()
    master = _start([master_bin, f"--rpc_port={port}", "--rpc_address=127.0.0.1",
                     f"--metrics_port={http_port}", "--metrics_host=127.0.0.1"], work / "master.log",
                    port=port)
    address = f"127.0.0.1:{port}"
    object_bytes = bytes_per_block + 64
    # Every round (the warm one too) saves its own keys; the master evicts once its pool is 90% full
    # (mooncake_master --eviction_high_watermark_ratio, default 0.9), so the holder lends room for
    # all of them at under 80%.
    segment = int(num_blocks * object_bytes * (repeats + 1) / 0.8) + (64 << 20)
    holder = _start([sys.executable, "-c", _HOLDER, address, str(segment)], work / "holder.log",
                    ready="holding")
    slots = HostSlots.in_memory(bytes_per_block, 2 * num_blocks)
    try:
        rng = np.random.default_rng(0)
        for i in range(0, num_blocks, 256):
            n = min(256, num_blocks - i)
            slots.array[i : i + n] = rng.integers(0, 256, (n, bytes_per_block), dtype=np.uint8)
        slots.array[num_blocks:] = 1  # restores land in faulted-in pages, as in the pinned L1 pool
        hasher = ChainHasher(BLOCK_SIZE, b"l3-bench")
        hashes = hasher.hashes(rng.integers(0, 100_000, num_blocks * BLOCK_SIZE, dtype=np.int32))
        stamp = L2Stamp("bench", BLOCK_SIZE, bytes_per_block, "random-bytes")
        settings = MooncakeSettings(master=address, bind_host="127.0.0.1", segment_bytes=0)
        store = L3Store(functools.partial(MooncakeKV.connect, settings), stamp, slots, hasher.root,
                        staging_bytes=staging_mb << 20, call_timeout_s=60, probe_timeout_s=30)

        async def run() -> list[tuple[float, float, float, bool, float]]:
            if not await store.start():
                raise RuntimeError(f"L3 did not connect: {store.off_reason}")
            # An untimed round first: it faults the holder's segment and both processes' buffers in.
            await _l3_runs(store, hashes, hasher.root, num_blocks, 1, f"warm{os.getpid()}")
            return await _l3_runs(store, hashes, hasher.root, num_blocks, repeats, f"bench{os.getpid()}")

        try:
            runs = asyncio.run(run())
        finally:
            store.close()
        nbytes = num_blocks * bytes_per_block
        save_s, probe_s, restore_s = (statistics.median(r[i] for r in runs) for i in range(3))
        raw_s = statistics.median(r[4] for r in runs)
        return {"save_s": save_s, "probe_s": probe_s, "restore_s": restore_s, "raw_get_s": raw_s,
                "bytes": nbytes,
                "save_gbps": nbytes / save_s / GB, "restore_gbps": nbytes / restore_s / GB,
                "identical": all(r[3] for r in runs), "staging_mb": staging_mb}
    finally:
        for proc in (holder, master):
            proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=500_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bytes-per-block", type=int, default=V41_FLASH_BYTES_PER_BLOCK)
    p.add_argument("--staging-mb", type=int, default=256, help="l3.buffer_mb")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="L2 directory (the local disk)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=352_000.0)
    p.add_argument("--json", default=None)
    add_quick(p, argv, tokens=8192, repeats=1, staging_mb=16)
    args = p.parse_args(argv)
    missing = mooncake_available() or (None if master_binary() else "no mooncake_master")
    if missing is not None:
        print(f"Mooncake's client is not installed ({missing}): bash scripts/setup_l3.sh", file=sys.stderr)
        return 2
    num_blocks = args.tokens // BLOCK_SIZE
    tokens = num_blocks * BLOCK_SIZE
    l3 = bench_l3(num_blocks, args.bytes_per_block, args.repeats, args.staging_mb)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    l2 = bench_l2(args.dir, num_blocks, args.bytes_per_block, 4, args.repeats, 16 << 20, True)
    prefill_s = tokens / args.prefill_tokens_per_s
    nbytes = l3["bytes"]
    print(f"{tokens:,} tokens of V4.1-Flash KV ({nbytes / 1e6:,.0f} MB, {args.bytes_per_block:,} B per "
          f"{BLOCK_SIZE}-token block), median of {args.repeats}:")
    print("| path | save s | restore s | restore GB/s | vs prefill |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| L3: Mooncake Store, another process over TCP loopback | {l3['save_s']:.3f} | "
          f"{l3['restore_s']:.3f} "
          f"(+ probe {l3['probe_s'] * 1e3:.1f} ms) | {l3['restore_gbps']:.2f} | "
          f"{prefill_s / (l3['restore_s'] + l3['probe_s']):.1f}x faster |")
    print(f"| (Mooncake's batched gets alone, same objects) | | {l3['raw_get_s']:.3f} | "
          f"{nbytes / l3['raw_get_s'] / GB:.2f} | |")
    print(f"| L2: local disk ({args.dir}, direct I/O {l2.direct}) | {l2.save_s:.3f} | {l2.restore_s:.3f} | "
          f"{l2.restore_gbps:.2f} | {prefill_s / l2.restore_s:.1f}x faster |")
    print(f"| prefill at {args.prefill_tokens_per_s:,.0f} tokens/s | | {prefill_s:.3f} | "
          f"{nbytes / prefill_s / GB:.2f} (break-even) | 1x |")
    print(f"restores byte-identical: L3 {l3['identical']}, L2 {l2.identical}")
    if args.json:
        l2_figures = {"save_s": l2.save_s, "restore_s": l2.restore_s, "restore_gbps": l2.restore_gbps}
        figures = {"tokens": tokens, "l3": l3, "l2": l2_figures, "prefill_s": prefill_s}
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if l3["identical"] and l2.identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
