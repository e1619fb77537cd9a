"""L2 throughput: a session's KV from the shared host pool to disk and back, next to the disk's
own sequential speed (and, with ``--prefill``, next to recomputing the same tokens on a GPU).

    python -m bench.l2_bench --dir /path/on/the/disk          # this machine (CPU only)
    python -m bench.l2_bench --dir /path/on/nvme --prefill    # H200: + cold prefill, large model
    python -m bench.l2_bench --quick                          # 4K tokens in the temp dir, CPU prefill

What it measures, in one process:

* ``raw``: ``cache.l2_io.measure_sequential``: one stream of ``--chunk-mb`` ``O_DIRECT`` writes
  of a scratch file, then reads of it with one read in flight (what ``dd oflag=direct`` /
  ``iflag=direct`` would show) and with each of ``--depths`` in flight (``fio --iodepth``);
* ``save`` / ``restore``: ``L2Store.save`` of a ``--tokens`` session held in a ``/dev/shm`` pool
  (mapped like the real L1 pool) into one extent per ``--threads`` setting (1 = no overlap), then
  ``L2Store.load`` of it into other slots once per ``--depths`` setting (restore reads in
  flight; 1 is the one-read-at-a-time reader). Payload bytes over wall time, median of
  ``--repeats``; every restore is compared byte for byte with what was saved. Each restore is
  set against raw reads of its own extent file taken just before and just after it, at every
  depth, the best of them ("of raw"): the disk's speed on the same bytes at the same moment,
  read however it reads fastest. Rows default to DeepSeek-V4.1-Flash's 114,048 B per 128-token
  block (891 B per token);
* ``--prefill`` (CUDA): the reference engine's ``large`` model (random weights, bf16) prefills a
  ``--prefill-tokens`` prompt cold; its KV blocks are exported to the host pool (GPU -> host),
  saved to L2, the host copy is wiped, then restored disk -> host (``L2Store.load``) -> GPU
  (``import_blocks``) and compared with the original rows on the GPU. Prints both times.

Nothing passes or fails on a stopwatch; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.support.quick import add_quick
from cache.hashing import ChainHasher
from cache.host_slots import HostSlots
from cache.l2_format import ALIGN, L2Stamp, align_up
from cache.l2_io import measure_read, measure_sequential, open_direct
from cache.l2_reader import READ_DEPTH
from cache.l2_store import L2Store
from server.preflight_checks.probe import RealSystemProbe

V41_FLASH_BYTES_PER_BLOCK = 114_048
BLOCK_SIZE = 128
GB = 1e9


@dataclass
class L2Run:
    threads: int
    save_s: float
    restore_s: float
    num_bytes: int
    identical: bool
    direct: bool
    of_raw: float = float("nan")  # median over rounds of restore / the best raw read of its extent file
    read_depth: int = 1  # restore reads in flight
    raw_read_gbps: float = float("nan")  # median over rounds of that best raw read

    @property
    def save_gbps(self) -> float:
        return self.num_bytes / self.save_s / GB

    @property
    def restore_gbps(self) -> float:
        return self.num_bytes / self.restore_s / GB


@dataclass
class _Restore:
    save_s: float
    restore_s: float
    raw_bps: float  # the best raw read of the same extent file, just before and just after the restore
    identical: bool


def _shm_slots(num_slots: int, bytes_per_block: int) -> tuple[HostSlots, str]:
    path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                        f"dib-l2-bench-{os.getpid()}")
    with open(path, "wb") as f:
        f.truncate(num_slots * bytes_per_block)
    return HostSlots.map_file(path, bytes_per_block, num_slots), path


def _raw_read_bps(directory: str, depths: list[int], chunk_bytes: int) -> float:
    """The best of raw ``O_DIRECT`` reads of the store's one extent file at each of ``depths``
    reads in flight (``measure_read``): the disk's speed on the very bytes about to be restored."""
    (name,) = [n for n in os.listdir(directory) if n.endswith(".kv")]
    fd, is_direct = open_direct(os.path.join(directory, name), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size // ALIGN * ALIGN
        nbytes = align_up(chunk_bytes)
        buffers = [np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8) for _ in range(max(depths))]
        for buf in buffers:
            buf[::ALIGN] = 0  # touched before the clock starts, as the restore's ring is
        best = 0.0
        for depth in depths:
            got, seconds = measure_read(fd, is_direct, size, buffers[:depth], max_seconds=60.0)
            best = max(best, got / seconds)
        return best
    finally:
        os.close(fd)


async def _save(store: L2Store, hashes: list, root: Any, num_blocks: int) -> tuple[float, bool]:
    started = time.perf_counter()
    saved = await store.save(hashes, root, 0)
    return time.perf_counter() - started, saved == num_blocks


async def _restore(store: L2Store, hashes: list, num_blocks: int) -> tuple[float, bool]:
    store.host.array[num_blocks : 2 * num_blocks] = 0
    started = time.perf_counter()
    loaded = await store.load(hashes, 0, num_blocks, num_blocks)
    restore_s = time.perf_counter() - started
    return restore_s, loaded == num_blocks and np.array_equal(store.host.array[:num_blocks],
                                                              store.host.array[num_blocks : 2 * num_blocks])


def bench_l2(directory: str, num_blocks: int, bytes_per_block: int, threads: int, repeats: int,
             chunk_bytes: int, direct: bool) -> L2Run:
    """One thread count at the store's default read depth, without the raw reads (``bench.l3_bench``)."""
    return bench_rounds(directory, num_blocks, bytes_per_block, [threads], repeats, chunk_bytes, direct,
                        raw=False)[0]


def bench_rounds(directory: str, num_blocks: int, bytes_per_block: int, thread_list: list[int], repeats: int,
                 chunk_bytes: int, direct: bool, depths: list[int] | None = None, raw: bool = True,
                 ) -> list[L2Run]:
    """``repeats`` rounds; each round saves the session once per thread count and restores it
    once per read depth, each restore between raw reads of the same extent file at one read in
    flight and at every depth (``_raw_read_bps``) and compared with the best of them, so a disk
    whose speed drifts (a shared machine, a virtual disk, an SSD still busy after a large write)
    moves a restore and its raw figure alike, and never in the restore's favour. The order of
    thread counts and of depths is reversed every other round. Returns, per (thread count,
    depth), the medians and the median of each round's restore / best raw read (NaN without
    ``raw``)."""
    depths = depths or [READ_DEPTH]
    raw_depths = sorted({1, *depths})  # one stream (dd) always among them

    def raw_bps() -> float:
        return _raw_read_bps(sub, raw_depths, chunk_bytes) if raw else float("nan")

    slots, shm = _shm_slots(2 * num_blocks, bytes_per_block)
    try:
        rng = np.random.default_rng(0)
        for i in range(0, num_blocks, 256):  # random bytes, a slab at a time
            n = min(256, num_blocks - i)
            slots.array[i : i + n] = rng.integers(0, 256, (n, bytes_per_block), dtype=np.uint8)
        hasher = ChainHasher(BLOCK_SIZE, b"l2-bench")
        tokens = rng.integers(0, 100_000, num_blocks * BLOCK_SIZE, dtype=np.int32)
        hashes = hasher.hashes(tokens)
        stamp = L2Stamp("bench", BLOCK_SIZE, bytes_per_block, "random-bytes")
        runs: dict[tuple[int, int], list[_Restore]] = {(t, d): [] for t in thread_list for d in depths}
        for round_ in range(repeats):
            flip = -1 if round_ % 2 else 1
            for threads in thread_list[::flip]:
                sub = tempfile.mkdtemp(prefix="l2-bench-", dir=directory)
                try:
                    save_s, saved = _stored(sub, num_blocks, bytes_per_block, stamp, slots, threads,
                                            chunk_bytes, direct, depths[0],
                                            lambda st: _save(st, hashes, hasher.root, num_blocks))
                    for depth in depths[::flip]:
                        before = raw_bps()
                        restore_s, same = _stored(sub, num_blocks, bytes_per_block, stamp, slots, threads,
                                                  chunk_bytes, direct, depth,
                                                  lambda st: _restore(st, hashes, num_blocks))
                        best = max(before, raw_bps())
                        runs[threads, depth].append(_Restore(save_s, restore_s, best, saved and same))
                finally:
                    shutil.rmtree(sub, ignore_errors=True)
        out = []
        nbytes = num_blocks * bytes_per_block
        for (threads, depth), rs in runs.items():
            out.append(L2Run(threads, statistics.median(r.save_s for r in rs),
                             statistics.median(r.restore_s for r in rs), nbytes, all(r.identical for r in rs),
                             direct, statistics.median(nbytes / r.restore_s / r.raw_bps for r in rs), depth,
                             statistics.median(r.raw_bps for r in rs) / GB))
        return out
    finally:
        del slots
        os.unlink(shm)


def _stored(sub: str, num_blocks: int, bytes_per_block: int, stamp: L2Stamp, slots: HostSlots, threads: int,
            chunk_bytes: int, direct: bool, depth: int, fn: Any) -> Any:
    """``fn(store)`` on a store over ``sub`` (opened: it finds the extent a previous store saved)."""
    bound = 2 * num_blocks * bytes_per_block + (64 << 20)
    store = L2Store(sub, bound, stamp, slots, io_threads=threads, chunk_bytes=chunk_bytes, direct=direct,
                    read_depth=depth, min_free_bytes=0)
    store.open()
    try:
        return asyncio.run(fn(store))
    finally:
        store.close()


def bench_prefill(directory: str, args: argparse.Namespace) -> dict[str, Any]:
    """Cold prefill vs L2 restore of the same tokens' KV (reference engine, CUDA)."""
    import torch

    from rank.engine import EngineRequest, SamplingParams
    from rank.host_budget import host_pool_path, unlink_host_pool
    from rank.host_pool import HostPool
    from rank.reference_engine import ReferenceEngine, ReferenceEngineConfig
    from rank.reference_model import MODEL_SPECS, kv_bytes_per_block

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    spec = MODEL_SPECS[args.model]
    bpb = kv_bytes_per_block(spec, BLOCK_SIZE, dtype)
    num_blocks = args.prefill_tokens // BLOCK_SIZE
    path = host_pool_path(f"l2-bench-{os.getpid()}")
    unlink_host_pool(path)
    host = HostPool(path, 2 * num_blocks * bpb, pin=device.type == "cuda")
    engine = ReferenceEngine(ReferenceEngineConfig(
        model=args.model, block_size=BLOCK_SIZE, num_blocks=2 * num_blocks + 64, device=str(device),
        max_num_batched_tokens=args.batched_tokens, max_model_len=args.prefill_tokens + 1024), host_pool=host)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def prefill(request_id: str, prompt: np.ndarray) -> tuple[float, list[int]]:
        sync()
        started = time.perf_counter()
        engine.add(EngineRequest(request_id, prompt, SamplingParams(max_tokens=1)))
        while True:
            done = [o for o in engine.step() if o.finished]
            if done:
                sync()
                return time.perf_counter() - started, done[0].kept_blocks

    def timed(fn: Any) -> tuple[float, Any]:
        sync()
        started = time.perf_counter()
        out = fn()
        sync()
        return time.perf_counter() - started, out

    try:
        rng = np.random.default_rng(1)
        warm_prompt = rng.integers(0, spec.vocab_size, 4 * BLOCK_SIZE + 1, dtype=np.int32)
        warm_s, warm_blocks = prefill("warm", warm_prompt)
        engine.release(warm_blocks)
        prompt = rng.integers(0, spec.vocab_size, num_blocks * BLOCK_SIZE + 1, dtype=np.int32)
        prefill_s, kept = prefill("cold", prompt)
        kept = kept[:num_blocks]
        export_s, _ = timed(lambda: engine.export_blocks(kept, 0))
        slots = HostSlots.map_file(path, bpb, host.num_slots)
        hasher = ChainHasher(BLOCK_SIZE, b"l2-bench")
        hashes = hasher.hashes(prompt)[:num_blocks]
        stamp = L2Stamp(f"reference:{args.model}", BLOCK_SIZE, bpb, f"bench:{dtype}")
        sub = tempfile.mkdtemp(prefix="l2-bench-prefill-", dir=directory)
        store = L2Store(sub, 2 * num_blocks * bpb + (64 << 20), stamp, slots,
                        io_threads=max(args.thread_list), min_free_bytes=0)
        store.open()
        try:
            save_s, saved = timed(lambda: asyncio.run(store.save(hashes, hasher.root, 0)))
            slots.array[:num_blocks] = 0
            load_s, loaded = timed(lambda: asyncio.run(store.load(hashes, 0, num_blocks, 0)))
        finally:
            store.close()
            shutil.rmtree(sub, ignore_errors=True)
        import_s, ids = timed(lambda: engine.import_blocks(0, num_blocks))
        original = torch.tensor(kept, dtype=torch.int64, device=device)
        restored = torch.tensor(ids, dtype=torch.int64, device=device)
        pool = engine.pool
        identical = bool(torch.equal(pool.index_select(0, original), pool.index_select(0, restored)))
        nbytes = num_blocks * bpb
        return {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "model": args.model, "tokens": num_blocks * BLOCK_SIZE, "bytes_per_block": bpb,
            "kv_bytes": nbytes,
            "warmup_prefill_s": warm_s, "prefill_s": prefill_s, "export_gpu_to_host_s": export_s,
            "l2_save_s": save_s, "l2_load_s": load_s, "import_host_to_gpu_s": import_s,
            "restore_s": load_s + import_s, "saved_blocks": saved, "loaded_blocks": loaded,
            "restored_identical": identical, "host_pinned": host.pinned,
        }
    finally:
        engine.host_pool = None
        host.close()
        unlink_host_pool(path)


def _print_prefill(pf: dict[str, Any]) -> None:
    kv_gb = pf["kv_bytes"] / GB
    print(f"\n{pf['device']}: reference '{pf['model']}' model, {pf['tokens']:,} tokens, KV {kv_gb:.2f} GB "
          f"({pf['bytes_per_block'] // BLOCK_SIZE:,} B/token), host pool pinned: {pf['host_pinned']}")
    rows = [("cold prefill", pf["prefill_s"], f"{pf['tokens'] / pf['prefill_s']:,.0f} tok/s"),
            ("export GPU -> host", pf["export_gpu_to_host_s"], ""),
            ("L2 save host -> disk", pf["l2_save_s"], f"{kv_gb / pf['l2_save_s']:.2f} GB/s"),
            ("L2 load disk -> host", pf["l2_load_s"], f"{kv_gb / pf['l2_load_s']:.2f} GB/s"),
            ("import host -> GPU", pf["import_host_to_gpu_s"], ""),
            ("restore (load + import)", pf["restore_s"],
             f"prefill / restore = {pf['prefill_s'] / pf['restore_s']:.2f}")]
    for label, seconds, note in rows:
        print(f"  {label:<28}{seconds * 1e3:10.1f} ms  {note}")
    print(f"  restored rows identical: {pf['restored_identical']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=".", help="directory on the disk to measure (scratch files removed)")
    parser.add_argument("--tokens", type=int, default=262_144, help="session length for save/restore")
    parser.add_argument("--bytes-per-block", type=int, default=V41_FLASH_BYTES_PER_BLOCK)
    parser.add_argument("--threads", default="1,4", help="L2 I/O thread counts to compare")
    parser.add_argument("--depths", default=str(READ_DEPTH),
                        help="restore reads in flight to compare (1: one read at a time)")
    parser.add_argument("--chunk-mb", type=int, default=16, help="save chunks and restore windows")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--raw-mb", type=int, default=1024, help="size of the raw sequential test")
    parser.add_argument("--buffered", action="store_true", help="L2 without O_DIRECT (for contrast)")
    parser.add_argument("--prefill", action="store_true", help="also time a cold prefill (needs CUDA)")
    parser.add_argument("--model", default="large", help="reference model for --prefill")
    parser.add_argument("--prefill-tokens", type=int, default=32_768)
    parser.add_argument("--batched-tokens", type=int, default=8192, help="prefill chunk per step")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", help="write the figures here")
    add_quick(parser, argv, dir=tempfile.gettempdir(), tokens=4096, raw_mb=16, repeats=1, threads="1,2",
              depths="1,2", chunk_mb=1, prefill=True, device="cpu", model="null", prefill_tokens=8448,
              batched_tokens=512)
    args = parser.parse_args(argv)
    args.thread_list = [int(t) for t in args.threads.split(",")]
    args.depth_list = [int(d) for d in args.depths.split(",")]
    if min(args.depth_list) < 1 or min(args.thread_list) < 1:
        parser.error("--threads and --depths take counts of 1 or more")
    directory = os.path.abspath(args.dir)
    os.makedirs(directory, exist_ok=True)
    num_blocks = args.tokens // BLOCK_SIZE
    nbytes = num_blocks * args.bytes_per_block

    raw = measure_sequential(directory, args.raw_mb << 20, args.chunk_mb << 20, max_seconds=20.0,
                             read_depths=tuple(d for d in args.depth_list if d > 1))
    fstype = RealSystemProbe().filesystem_type(Path(directory))
    mode = "O_DIRECT" if raw.is_direct else "buffered"
    deeper = "".join(f", {d} in flight {bps / GB:.2f}" for d, bps in raw.read_bps_at_depth.items())
    print(f"disk under {directory} ({fstype}): raw sequential ({mode}, {args.chunk_mb} MiB) write "
          f"{raw.write_bytes_per_s / GB:.2f} GB/s; read GB/s: 1 in flight {raw.read_bytes_per_s / GB:.2f}"
          f"{deeper} ({raw.read_bytes >> 20} MiB)")
    print(f"session: {args.tokens:,} tokens = {num_blocks:,} blocks x {args.bytes_per_block:,} B = "
          f"{nbytes / 1e6:,.1f} MB; windows {args.chunk_mb} MiB; median of {args.repeats}")
    runs = bench_rounds(directory, num_blocks, args.bytes_per_block, args.thread_list, args.repeats,
                        args.chunk_mb << 20, raw.is_direct and not args.buffered, args.depth_list)
    raw_depths = ",".join(str(d) for d in sorted({1, *args.depth_list}))
    print(f"raw: the best raw read of the saved extent file at {raw_depths} reads in flight, just before "
          "and just after each restore; of raw: the median over rounds of restore / that raw")
    print(f"{'L2 threads':<12}{'reads':>6}{'save GB/s':>10}{'raw GB/s':>10}{'restore GB/s':>14}{'of raw':>8}"
          f"{'restore tok/s':>15}{'identical':>11}{'direct':>8}")
    for r in runs:
        tok_s = num_blocks * BLOCK_SIZE / r.restore_s
        print(f"{r.threads:<12}{r.read_depth:>6}{r.save_gbps:>10.2f}{r.raw_read_gbps:>10.2f}{r.restore_gbps:>14.2f}"
              f"{r.of_raw:>8.0%}{tok_s:>15,.0f}{r.identical!s:>11}{r.direct!s:>8}")
    result: dict[str, Any] = {
        "dir": directory, "fstype": fstype, "tokens": args.tokens, "bytes_per_block": args.bytes_per_block,
        "raw": asdict(raw) | {"write_gbps": raw.write_bytes_per_s / GB,
                              "read_gbps": raw.read_bytes_per_s / GB,
                              "best_read_gbps": raw.best_read_bytes_per_s / GB},
        "l2": [asdict(r) | {"save_gbps": r.save_gbps, "restore_gbps": r.restore_gbps} for r in runs],
    }
    if args.prefill:
        result["prefill"] = bench_prefill(directory, args)
        _print_prefill(result["prefill"])
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
