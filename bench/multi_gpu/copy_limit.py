"""The pinned-copy limit for L1 restores, measured on one device in its own process.

    CUDA_VISIBLE_DEVICES=1 python -m bench.multi_gpu.copy_limit --bytes-per-block 3145728 \
        --sizes 1,4,16,64,256 --out copy.json
    python -m bench.multi_gpu.copy_limit --quick    # 64 KiB blocks, sizes 1,4, on the CPU, no file

For each restore size (blocks of the engine's row size) it times, alternating, with the median
of ``--repeats``:

* ``contiguous_s``: one pinned-host -> device copy of that many bytes into one device buffer
  (the link's limit for that size: no restore can be faster);
* ``import_s``: ``HostPool.copy_to_device``, the copy a rank's ``import_blocks`` makes (one DMA
  of consecutive host slots into a staging buffer, one ``index_copy_`` into scattered rows of a
  block pool, synchronize).

The host buffer is a real ``HostPool`` (a ``/dev/shm`` file mapped shared, pinned with
``cudaHostRegister`` on CUDA), so the figure is for the same memory the ranks use. On CPU the
same code path runs (a memcpy), which only checks the script.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import Any

import orjson
import torch

from bench.support.quick import add_quick
from rank.host_budget import host_pool_path, unlink_host_pool
from rank.host_pool import HostPool


def _timed(fn: Any, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(bytes_per_block: int, sizes_blocks: list[int], repeats: int, device_name: str) -> dict[str, Any]:
    device = torch.device(device_name)
    max_blocks = max(sizes_blocks)
    spare = max(16, max_blocks // 4)
    pool_rows = max_blocks + spare + 1
    path = host_pool_path(f"mgpu-copy-{os.getpid()}")
    unlink_host_pool(path)
    host = HostPool(path, max_blocks * bytes_per_block, pin=device.type == "cuda")
    host.open(bytes_per_block)
    rows: list[dict[str, Any]] = []
    try:
        assert host.tensor is not None
        host.tensor.view(-1)[:: 4096] = 7  # first touch outside the timed region
        pool = torch.zeros(pool_rows, bytes_per_block, dtype=torch.uint8, device=device)
        gen = torch.Generator().manual_seed(0)
        for n in sizes_blocks:
            nbytes = n * bytes_per_block
            src = host.tensor[:n]
            # the reference copy reads a pinned buffer of its own: one copy may not span two of
            # the pool's pin chunks (rank/host_pin.py); .pin_memory() of a registered range returns it
            ref = torch.empty_like(src, pin_memory=device.type == "cuda").copy_(src)  # not .pin_memory()
            dst = torch.empty(n, bytes_per_block, dtype=torch.uint8, device=device)
            # Scattered destination rows, as in a busy pool.
            ids = (torch.randperm(pool_rows - 1, generator=gen)[:n] + 1).tolist()

            # bound now, for this size (the timed callables must not see a later iteration's tensors)
            contiguous = functools.partial(dst.copy_, ref, non_blocking=device.type == "cuda")
            restore = functools.partial(host.copy_to_device, pool, ids, 0)

            contiguous()
            restore()
            t_copy, t_import = [], []
            for _ in range(repeats):
                t_copy.append(_timed(contiguous, device))
                t_import.append(_timed(restore, device))
            ok = bool(torch.equal(pool[torch.tensor(ids, device=device)].cpu(), src))
            c, i = statistics.median(t_copy), statistics.median(t_import)
            rows.append({"blocks": n, "bytes": nbytes, "contiguous_s": c, "import_s": i,
                         "contiguous_gb_s": nbytes / c / 1e9, "import_gb_s": nbytes / i / 1e9,
                         "import_over_copy": i / c, "bytes_identical": ok})
            del dst, ref, contiguous
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        return {"device": name, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                "pinned": host.pinned, "bytes_per_block": bytes_per_block,
                "repeats": repeats, "sizes": rows}
    finally:
        host.close()
        unlink_host_pool(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes-per-block", type=int, required=True)
    p.add_argument("--sizes", default="1,4,16,64,256", help="restore sizes in blocks")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    add_quick(p, argv, bytes_per_block=65_536, sizes="1,4", repeats=1, device="cpu", out=None)
    args = p.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    if not sizes or sizes[0] < 1 or args.bytes_per_block < 1:
        print("error: sizes and --bytes-per-block must be positive", file=sys.stderr)
        return 2
    result = measure(args.bytes_per_block, sizes, args.repeats, args.device)
    if args.out:
        with open(args.out, "wb") as f:
            f.write(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    for row in result["sizes"]:
        print(f"{result['device']}: {row['blocks']:>5} blocks {row['bytes'] / 1e6:>9.1f} MB  contiguous "
              f"{row['contiguous_s'] * 1e3:8.2f} ms ({row['contiguous_gb_s']:5.1f} GB/s)  import "
              f"{row['import_s'] * 1e3:8.2f} ms  x{row['import_over_copy']:.2f}  ok={row['bytes_identical']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
