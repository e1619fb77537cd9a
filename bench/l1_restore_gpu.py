"""L1 restore bandwidth: one session's KV from the shared host pool into an engine's block pool.

``python -m bench.l1_restore_gpu`` (on a CUDA machine; ``--device cpu --tokens 65536`` runs the
same code path on CPU as a smoke test; ``--quick``: 4,096 tokens on the CPU, ``--quick --device
cuda`` the same on a GPU).

What it measures, in one process and one run:

* ``contiguous``: one pinned-host -> GPU copy of the session's bytes into one device buffer
  (the physical reference: the link's speed for this size);
* ``import``: ``ReferenceEngine.import_blocks`` -> ``HostPool.copy_to_device``, the path a
  restore takes in a rank: allocate fresh block ids, one DMA of the session's consecutive host
  slots into a device staging buffer, one ``index_copy_`` scatter into the (non-contiguous)
  block rows, synchronize. The blocks are released after each run;
* ``per-block``: one ``copy_`` per block (what a naive restore does), once, for contrast.

The block pool uses DeepSeek-V4.1-Flash's row size (114,048 B per 128-token block, ~891 B per
token, the ``deepinfer==0.1.0`` sdist, ``docs/deepinfer.md``) instead of the reference model's,
so a 1M-token session is 7,812 rows / 891 MB as on the real engine. Runs alternate between the
two methods so clock and thermal drift hit both alike; the median of ``--repeats`` is reported.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

from bench.support.quick import add_quick
from rank.host_budget import host_pool_path, unlink_host_pool
from rank.host_pool import HostPool
from rank.pool_transfers import PoolTransfers
from rank.reference_engine import ReferenceEngine, ReferenceEngineConfig

V41_FLASH_BYTES_PER_BLOCK = 114_048
BLOCK_SIZE = 128


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: object, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    _sync(device)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--bytes-per-block", type=int, default=V41_FLASH_BYTES_PER_BLOCK)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--spare-blocks", type=int, default=1024, help="extra rows in the block pool")
    add_quick(parser, argv, tokens=4096, device="cpu", repeats=1, spare_blocks=8)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    bpb = args.bytes_per_block
    num_blocks = args.tokens // BLOCK_SIZE
    nbytes = num_blocks * bpb
    pool_rows = num_blocks + args.spare_blocks + 1

    # The real engine, with V4.1-Flash's row size: built with the null model (no weights), then
    # its block pool is sized to the real layout before any block is used.
    engine = ReferenceEngine(ReferenceEngineConfig(model="null", block_size=BLOCK_SIZE, num_blocks=pool_rows,
                                                   device=str(device)))
    engine.pool = torch.zeros(pool_rows, bpb, dtype=torch.uint8, device=device)
    engine.bytes_per_block = bpb
    path = host_pool_path(f"bench-restore-{os.getpid()}")
    unlink_host_pool(path)
    host = HostPool(path, nbytes, pin=device.type == "cuda")
    host.open(bpb)
    # The engine was built without a pool (its null model's row size); its transfers get this one.
    engine.host_pool = host
    engine.transfers = PoolTransfers(engine.blocks, host, device)
    try:
        assert host.tensor is not None and host.num_slots == num_blocks
        # Random session bytes, written into the host slots once.
        gen = torch.Generator(device=device).manual_seed(0)
        src_dev = torch.randint(0, 256, (num_blocks, bpb), dtype=torch.uint8, device=device, generator=gen)
        host.tensor.copy_(src_dev.cpu() if device.type == "cuda" else src_dev)
        # Fragment the free list so the imported rows are scattered, as in a busy pool.
        held = engine.blocks.allocate(args.spare_blocks, cache_ref=True)
        engine.release(held[::2])
        # The reference copy reads a pinned buffer of its own: the pool is registered in chunks
        # (rank/host_pin.py), and one copy may not span two registrations.
        flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        flat_host.copy_(host.tensor.view(-1))  # (pin_memory() of a registered range returns the range)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def contiguous() -> None:
            dst.copy_(flat_host, non_blocking=device.type == "cuda")

        ids_box: list[list[int]] = []

        def restore() -> None:
            ids_box.append(engine.import_blocks(0, num_blocks))

        # Warm-up (allocator, registration, first-touch), then check the restored bytes.
        contiguous()
        restore()
        ids = ids_box.pop()
        idx = torch.tensor(ids, dtype=torch.int64, device=device)
        ok = bool(torch.equal(engine.pool.index_select(0, idx), src_dev))
        engine.release(ids)
        t_copy: list[float] = []
        t_import: list[float] = []
        for _ in range(args.repeats):
            t_copy.append(_timed(contiguous, device))
            t_import.append(_timed(restore, device))
            engine.release(ids_box.pop())
        per_block_s = float("nan")
        if device.type == "cuda":
            rows = engine.blocks.allocate(num_blocks, cache_ref=True)

            def per_block() -> None:
                for slot, row in enumerate(rows):
                    engine.pool[row].copy_(host.tensor[slot], non_blocking=True)

            per_block_s = _timed(per_block, device)
            engine.release(rows)
        engine.release(held[1::2])
        engine.check_accounting()

        copy_s = statistics.median(t_copy)
        import_s = statistics.median(t_import)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"device: {name}; torch {torch.__version__}; host pool pinned: "
              f"{host.pinned}")
        print(f"session: {args.tokens:,} tokens = {num_blocks:,} blocks x {bpb:,} B = {nbytes / 1e6:,.1f} "
              "MB; "
              f"restored bytes identical: {ok}")
        print(f"{'method':<34}{'median ms':>10}{'min ms':>10}{'GB/s':>8}{'x copy':>8}")
        rows_out = [
            ("contiguous pinned->device copy", copy_s, min(t_copy)),
            ("import_blocks (DMA + scatter)", import_s, min(t_import)),
        ]
        if not math.isnan(per_block_s):
            rows_out.append(("one copy_ per block (contrast)", per_block_s, per_block_s))
        for label, med, best in rows_out:
            print(f"{label:<34}{med * 1e3:>10.2f}{best * 1e3:>10.2f}{nbytes / med / 1e9:>8.1f}"
                  f"{med / copy_s:>8.2f}")
        print(f"import / contiguous copy = {import_s / copy_s:.3f} (target <= 1.25)")
    finally:
        engine.host_pool = None
        host.close()
        unlink_host_pool(path)


if __name__ == "__main__":
    main()
