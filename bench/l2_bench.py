"""L2 throughput: a session's KV from the shared host pool to disk and back, next to the disk's
own sequential speed (and, with ``--prefill``, next to recomputing the same tokens on a GPU).

    python -m bench.l2_bench --dir /path/on/the/disk          # this machine (CPU only)
    python -m bench.l2_bench --dir /path/on/nvme --prefill    # H200: + cold prefill, large model
    python -m bench.l2_bench --quick                          # 4K tokens in the temp dir, CPU prefill

What it measures, in one process:

* ``raw``: ``cache.l2_io.measure_sequential``: one stream of 16 MiB ``O_DIRECT`` writes of a
  scratch file, then reads of it (what ``dd oflag=direct`` / ``iflag=direct`` would show);
* ``save`` / ``restore``: ``L2Store.save`` of a ``--tokens`` session held in a ``/dev/shm`` pool
  (mapped like the real L1 pool) into one extent, then ``L2Store.load`` of it into other slots,
  per ``--threads`` setting (1 = no overlap). Payload bytes over wall time, median of
  ``--repeats``; every restore is compared byte for byte with what was saved. Rows default to
  DeepSeek-V4.1-Flash's 114,048 B per 128-token block (891 B per token);
* ``--prefill`` (CUDA): the reference engine's ``large`` model (random weights, bf16) prefills a
  ``--prefill-tokens`` prompt cold; its KV blocks are exported to the host pool (GPU -> host),
  saved to L2, the host copy is wiped, then restored disk -> host (``L2Store.load``) -> GPU
  (``import_blocks``) and compared with the original rows on the GPU. Prints both times.

Nothing passes or fails on a stopwatch; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
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
from cache.l2_format import L2Stamp
from cache.l2_io import DiskSpeed, measure_sequential
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
    of_raw: float = float("nan")  # median over rounds of this round's restore / raw read speed

    @property
    def save_gbps(self) -> float:
        return self.num_bytes / self.save_s / GB

    @property
    def restore_gbps(self) -> float:
        return self.num_bytes / self.restore_s / GB


def _shm_slots(num_slots: int, bytes_per_block: int) -> tuple[HostSlots, str]:
    path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                        f"dib-l2-bench-{os.getpid()}")
    with open(path, "wb") as f:
        f.truncate(num_slots * bytes_per_block)
    return HostSlots.map_file(path, bytes_per_block, num_slots), path


async def _save_restore(store: L2Store, hashes: list, root: Any, num_blocks: int,
                        ) -> tuple[float, float, bool]:
    started = time.perf_counter()
    saved = await store.save(hashes, root, 0)
    save_s = time.perf_counter() - started
    store.host.array[num_blocks : 2 * num_blocks] = 0
    started = time.perf_counter()
    loaded = await store.load(hashes, 0, num_blocks, num_blocks)
    restore_s = time.perf_counter() - started
    same = saved == loaded == num_blocks and np.array_equal(store.host.array[:num_blocks],
                                                            store.host.array[num_blocks : 2 * num_blocks])
    return save_s, restore_s, same


def bench_l2(directory: str, num_blocks: int, bytes_per_block: int, threads: int, repeats: int,
             chunk_bytes: int, direct: bool) -> L2Run:
    return bench_rounds(directory, num_blocks, bytes_per_block, [threads], repeats, chunk_bytes, direct)[1][0]


def bench_rounds(directory: str, num_blocks: int, bytes_per_block: int, thread_list: list[int], repeats: int,
                 chunk_bytes: int, direct: bool, raw: bool = False) -> tuple[list[DiskSpeed], list[L2Run]]:
    """``repeats`` rounds; each round runs the raw sequential test (with ``raw``, on the session's
    byte count) and then one save + restore per thread count, so a disk whose speed drifts (a
    shared machine, a virtual disk) moves every column alike. Returns the raw runs and, per thread
    count, the medians and the median of each round's restore / raw read ratio."""
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
        raws: list[DiskSpeed] = []
        runs: dict[int, list[tuple[float, float, bool]]] = {t: [] for t in thread_list}
        for _ in range(repeats):
            if raw:
                raws.append(measure_sequential(directory, num_blocks * bytes_per_block, max_seconds=60.0))
            for threads in thread_list:
                sub = tempfile.mkdtemp(prefix="l2-bench-", dir=directory)
                bound = 2 * num_blocks * bytes_per_block + (64 << 20)
                store = L2Store(sub, bound, stamp, slots, io_threads=threads, chunk_bytes=chunk_bytes,
                                direct=direct, min_free_bytes=0)
                store.open()
                try:
                    runs[threads].append(asyncio.run(_save_restore(store, hashes, hasher.root, num_blocks)))
                finally:
                    store.close()
                    shutil.rmtree(sub, ignore_errors=True)
        out = []
        for threads in thread_list:
            save_s = statistics.median(r[0] for r in runs[threads])
            restore_s = statistics.median(r[1] for r in runs[threads])
            same = all(r[2] for r in runs[threads])
            nbytes = num_blocks * bytes_per_block
            paired = [nbytes / r[1] / rw.read_bytes_per_s for rw, r in zip(raws, runs[threads])]
            of_raw = statistics.median(paired) if paired else float("nan")
            out.append(L2Run(threads, save_s, restore_s, nbytes, same, direct, of_raw))
        return raws, out
    finally:
        del slots
        os.unlink(shm)


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
            "restored_identical": identical, "host_pinned": host._registered_ptr is not None,
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
    parser.add_argument("--chunk-mb", type=int, default=16)
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
              chunk_mb=1, prefill=True, device="cpu", model="null", prefill_tokens=8448, batched_tokens=512)
    args = parser.parse_args(argv)
    args.thread_list = [int(t) for t in args.threads.split(",")]
    directory = os.path.abspath(args.dir)
    os.makedirs(directory, exist_ok=True)
    num_blocks = args.tokens // BLOCK_SIZE
    nbytes = num_blocks * args.bytes_per_block

    raw = measure_sequential(directory, args.raw_mb << 20, max_seconds=20.0)
    fstype = RealSystemProbe().filesystem_type(Path(directory))
    mode = "O_DIRECT" if raw.is_direct else "buffered"
    print(f"disk under {directory} ({fstype}): raw sequential ({mode}, 16 MiB, one stream) write "
          f"{raw.write_bytes_per_s / GB:.2f} GB/s, read {raw.read_bytes_per_s / GB:.2f} GB/s "
          f"({raw.read_bytes >> 20} MiB)")
    print(f"session: {args.tokens:,} tokens = {num_blocks:,} blocks x {args.bytes_per_block:,} B = "
          f"{nbytes / 1e6:,.1f} MB; chunks {args.chunk_mb} MiB; median of {args.repeats}")
    raws, runs = bench_rounds(directory, num_blocks, args.bytes_per_block, args.thread_list, args.repeats,
                              args.chunk_mb << 20, raw.is_direct and not args.buffered, raw=True)
    raw_read_gbps = statistics.median(r.read_bytes_per_s for r in raws) / GB
    print(f"raw sequential read of the session's bytes, interleaved with the rounds: "
          f"{raw_read_gbps:.2f} GB/s (median of {len(raws)})")
    print("of raw: the median over rounds of the round's restore speed / its raw read speed")
    print(f"{'L2 threads':<12}{'save GB/s':>10}{'restore GB/s':>14}{'of raw':>8}{'restore tok/s':>15}"
          f"{'identical':>11}{'direct':>8}")
    for r in runs:
        tok_s = num_blocks * BLOCK_SIZE / r.restore_s
        of_raw = r.of_raw
        print(f"{r.threads:<12}{r.save_gbps:>10.2f}{r.restore_gbps:>14.2f}{of_raw:>8.0%}{tok_s:>15,.0f}"
              f"{r.identical!s:>11}{r.direct!s:>8}")
    result: dict[str, Any] = {
        "dir": directory, "fstype": fstype, "tokens": args.tokens, "bytes_per_block": args.bytes_per_block,
        "raw": asdict(raw) | {"write_gbps": raw.write_bytes_per_s / GB,
                              "read_gbps": raw.read_bytes_per_s / GB},
        "raw_rounds": [asdict(r) for r in raws], "raw_read_gbps_interleaved": raw_read_gbps,
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
