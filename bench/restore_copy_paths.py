"""Two ways to move L1 slots into scattered KV block rows on a GPU, idle and beside a busy stream.

    python -m bench.restore_copy_paths --block-bytes 3145728 --blocks 54     # H200: medium, 128-token blocks
    python -m bench.restore_copy_paths --quick      # still a CUDA device: 8 blocks of 64 KiB, 3 repeats

Why: in the serving run (``bench.multi_gpu_run``) an import's engine call, not
its messages, took most of a restore's round trip: 4.7 ms p50 / 10.8 ms p95 for a copy the link
does in ~3.4 ms (``RankGroup.transfer_log``, ``rank/link.py`` ``TransferTiming``). The import moves
consecutive host slots to a device staging buffer with one DMA and scatters it into the block rows
with an ``index_copy_`` kernel, after an index tensor's own synchronous upload. Beside a step the
kernel waits for streaming multiprocessors that the step's kernels hold. The alternative here
copies each run of consecutive block ids straight from the pinned slots into its rows
(``cudaMemcpyAsync`` only: the copy engines, no kernel, no staging, no index upload).

Paths, each timed from the call to its stream's synchronize, median and p95 over ``--repeats``:

* ``gather``: the staging + ``index_copy_`` path (``rank/host_pool.py`` ``by_kernel``: the only
  path before, now the one for stretches of adjacent runs shorter than ``DIRECT_MIN_RUN_BYTES``);
* ``runs``: one H2D copy per run of consecutive ids (``by_runs``);
* ``contiguous``: one H2D copy of the same bytes into consecutive rows (the link's limit).

Block ids (``--layouts``): ``random`` (a fragmented free list, worst case: runs of ~1 block),
``sorted`` (the same ids in order), ``runs4`` (runs of 4). ``--busy`` runs bf16 matmuls on the
default stream the whole time, as a step would (set 0 for an idle GPU). Printed, not asserted.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import threading
import time
from collections.abc import Callable

import torch

from bench.support.quick import add_quick
from rank.host_budget import SHM_DIR
from rank.host_pool import HostPool, by_kernel, by_runs, runs


def _path(fn: Callable[..., None], pool: torch.Tensor, src: torch.Tensor, ids: list[int],
          stream: torch.cuda.Stream) -> None:
    with torch.cuda.stream(stream):
        fn(pool, src, runs(ids) if fn is by_runs else ids, True, True)
    stream.synchronize()


def _contiguous(pool: torch.Tensor, src: torch.Tensor, ids: list[int], stream: torch.cuda.Stream) -> None:
    with torch.cuda.stream(stream):
        pool[1:1 + len(ids)].copy_(src, non_blocking=True)
    stream.synchronize()


def _layout(name: str, n: int, num_rows: int, rng: random.Random) -> list[int]:
    if name == "runs4":
        starts = rng.sample(range(1, num_rows // 4), (n + 3) // 4)
        return [4 * s + i for s in starts for i in range(4)][:n]
    ids = rng.sample(range(1, num_rows), n)
    return sorted(ids) if name == "sorted" else ids


def _busy(stop: threading.Event, device: torch.device) -> None:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.current_stream(device).synchronize()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-bytes", type=int, default=3 << 20)
    parser.add_argument("--blocks", type=int, default=54)
    parser.add_argument("--rows", type=int, default=768, help="device pool rows")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--busy", type=int, default=1, choices=[0, 1])
    parser.add_argument("--layouts", default="random,sorted,runs4")
    parser.add_argument("--seed", type=int, default=0)
    add_quick(parser, argv, block_bytes=65_536, blocks=8, rows=32, repeats=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.restore_copy_paths needs a CUDA device")
    device = torch.device("cuda")
    path = os.path.join(SHM_DIR, f"dib-copy-paths-{os.getpid()}")
    host = HostPool(path, args.block_bytes * args.blocks)
    host.open(args.block_bytes)
    pool = torch.zeros(args.rows, args.block_bytes, dtype=torch.uint8, device=device)
    src = host.tensor[: args.blocks] if host.tensor is not None else None
    assert src is not None
    src.copy_(torch.randint(0, 255, src.shape, dtype=torch.uint8))
    rng = random.Random(args.seed)
    stop = threading.Event()
    busy = threading.Thread(target=_busy, args=(stop, device), daemon=True)
    results: dict[str, list[float]] = {}

    paths: dict[str, Callable[[torch.Tensor, torch.Tensor, list[int], torch.cuda.Stream], None]] = {
        "gather": functools.partial(_path, by_kernel), "runs": functools.partial(_path, by_runs),
        "contiguous": _contiguous}

    try:
        if args.busy:
            busy.start()
            time.sleep(1.0)
        for priority in (0, -1):
            stream = torch.cuda.Stream(device, priority=priority)  # type: ignore[no-untyped-call]
            for layout in args.layouts.split(","):
                for i in range(args.repeats + 3):
                    ids = _layout(layout, args.blocks, args.rows, rng)
                    tag = f"prio {priority:+d} {layout:7s}"
                    for name, fn in paths.items():
                        start = time.perf_counter()
                        fn(pool, src, ids, stream)
                        if i >= 3:  # the first ones warm the allocator and the copy engines
                            results.setdefault(f"{tag} {name:10s}", []).append(time.perf_counter() - start)
                    if i == 3:  # both paths put the slots' bytes in the rows
                        for copy in (by_kernel, by_runs):
                            pool.zero_()
                            torch.cuda.synchronize()
                            _path(copy, pool, src, ids, stream)
                            assert torch.equal(pool[torch.tensor(ids, device=device)].cpu(), src)
    finally:
        stop.set()
        if busy.is_alive():
            busy.join()
        host.close()
        os.unlink(path)
    nbytes = args.block_bytes * args.blocks
    print(f"{args.blocks} blocks x {args.block_bytes / 2**20:.2f} MiB = {nbytes / 2**20:.0f} MiB; "
          f"busy stream: {'yes' if args.busy else 'no'}; {args.repeats} repeats")
    print(f"{'path':36s} {'p50 ms':>8s} {'p95 ms':>8s} {'GB/s p50':>9s}")
    for name, values in results.items():
        values.sort()
        p50 = statistics.median(values)
        p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
        print(f"{name:36s} {p50 * 1e3:8.2f} {p95 * 1e3:8.2f} {nbytes / p50 / 1e9:9.1f}")


if __name__ == "__main__":
    main()
