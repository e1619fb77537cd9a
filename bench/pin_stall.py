"""What pinning the L1 pool costs the rest of a rank: how long the CUDA driver is held at once.

``python -m bench.pin_stall --gb 24`` (a CUDA host; ``--quick``: the simulated pin on the CPU).

Pins a fresh ``/dev/shm`` pool in a background thread (``HostPool.start_pin``) while the main
thread runs a probe that needs the driver, as a rank's engine build and steps do: a small
allocation straight from the driver (``torch.cuda.empty_cache`` first, so it is a real
``cudaMalloc``), a matmul and a synchronize. It prints, per mode, the pin's time, its prefault
share, the longest single register, and the probe's p50 / p99 / max before and during the pin:

* ``one-register``: the pool registered by one call without a prefault (the pin before
  ``rank/host_pin.py``);
* ``chunked``: ``rank/host_pin.py`` as a rank runs it (prefault, then ``--chunk-mb`` registers);
* ``chunked, re-pin``: the same file pinned again, its pages already there (a rank-group restart).

Figures are in ``docs/cache.md`` ("L1 pinning").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from bench.support.quick import add_quick
from rank import host_pin
from rank.host_budget import GIB, host_pool_path, unlink_host_pool
from rank.host_pool import HostPool

BYTES_PER_BLOCK = 114_048  # DeepSeek-V4.1-Flash's 128-token row (bench/l1_restore_gpu.py)


def _probe(device: torch.device) -> Callable[[], None]:
    if device.type != "cuda":
        cpu = torch.randn(256, 256)

        def run_cpu() -> None:
            (cpu @ cpu).sum().item()

        return run_cpu
    x = torch.randn(1024, 1024, device=device)

    def run() -> None:
        torch.cuda.empty_cache()
        scratch = torch.empty(32 << 20, dtype=torch.uint8, device=device)  # a cudaMalloc
        (x @ x).sum().item()  # a launch and a synchronize
        del scratch

    return run


def _percentiles(samples: list[float]) -> str:
    if not samples:
        return "- / - / -"
    s = sorted(samples)
    return (f"{statistics.median(s) * 1e3:.2f} / {s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3:.2f} / "
            f"{s[-1] * 1e3:.1f}")


def _run(mode: str, path: str, nbytes: int, chunk_bytes: int, device: torch.device,
         baseline_s: float) -> None:
    probe = _probe(device)
    before: list[float] = []
    deadline = time.perf_counter() + baseline_s
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        probe()
        before.append(time.perf_counter() - t0)
    pool = HostPool(path, nbytes, pin=device.type == "cuda", background_pin=True, pin_chunk_bytes=chunk_bytes)
    pool.open(BYTES_PER_BLOCK)
    during: list[float] = []
    started = time.perf_counter()
    pool.start_pin()
    assert pool._pin_thread is not None
    while pool._pin_thread.is_alive():
        t0 = time.perf_counter()
        probe()
        during.append(time.perf_counter() - t0)
    chunks = pool._chunks
    assert chunks is not None
    total = time.perf_counter() - started
    print(f"{mode:<17} {nbytes / GIB:6.1f} {chunks.num_chunks:7d} {total:7.1f} {chunks.prefault_s:9.1f} "
          f"{chunks.longest_hold_s * 1e3:10.0f}   {_percentiles(before):<20} {_percentiles(during):<22} "
          f"{len(during)}")
    pool.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=24.0, help="pool size, GiB")
    parser.add_argument("--chunk-mb", type=int, default=host_pin.PIN_CHUNK_BYTES >> 20)
    parser.add_argument("--baseline-s", type=float, default=2.0, help="probe seconds before each pin")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_quick(parser, argv, gb=0.05, chunk_mb=16, baseline_s=0.2, device="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":  # nothing to register: the test knob stands in for the register
        os.environ.setdefault(host_pin.PIN_DELAY_ENV, "4")
    group = 32 * BYTES_PER_BLOCK  # page-aligned: "one-register" is then one chunk
    nbytes = max(1, int(args.gb * GIB) // group) * group
    path = host_pool_path(f"pin-stall-{os.getpid()}")
    print(f"{args.gb} GiB pool of {BYTES_PER_BLOCK}-byte slots on {device}; probe: cudaMalloc + matmul + "
          f"synchronize; ms p50 / p99 / max")
    print(f"{'mode':<17} {'GiB':>6} {'chunks':>7} {'pin s':>7} {'prefault':>9} {'longest ms':>10}   "
          f"{'probe before':<20} {'probe during pin':<22} probes")
    real_prefault = host_pin.prefault
    try:
        unlink_host_pool(path)
        host_pin.prefault = lambda ptr, size: False  # the old pin: the register faults the pages
        _run("one-register", path, nbytes, nbytes, device, args.baseline_s)
        host_pin.prefault = real_prefault
        unlink_host_pool(path)  # fresh pages again
        _run("chunked", path, nbytes, args.chunk_mb << 20, device, args.baseline_s)
        _run("chunked, re-pin", path, nbytes, args.chunk_mb << 20, device, args.baseline_s)
    finally:
        host_pin.prefault = real_prefault
        unlink_host_pool(path)


if __name__ == "__main__":
    main()
