"""How long an L1 import waits for DeepInfer's CUDA fence, on a GPU, under DeepInfer's step pattern.

    python -m bench.fence_wait                       # a CUDA device; defaults below
    python -m bench.fence_wait --decode-ms 30 --prompt-ms 400 --prompt-every 10 --blocks 54 --block-mib 3
    python -m bench.fence_wait --quick               # still a CUDA device: 2/10 ms steps, 10 small imports

DeepInfer's kernels need SM100, so stand-in kernels replay the ordering of its step calls with
zero-overhead scheduling (deepinfer/worker/worker.py ``execute_model_step``): per call the loop
thread queues the forward (``torch.cuda._sleep`` for the step's GPU time), waits on the host for
the previous step's sample event (its post-process), queues the sample (a tiny kernel) and records
its event; a prompt call then waits for its own step in place. After each call it runs the
product's ``DeepInferTransfers.fence()`` (rank/deepinfer_transfers.py), as the adapter does. A
second thread, at random moments, imports ``--blocks`` blocks of ``--block-mib`` from a pinned L1
pool with the product's ``DeepInferTransfers.import_`` and releases them, timing each import:

* ``fenced``: the product's path (side stream, waits on the device for the latest fence);
* ``unfenced``: the same without the fence (unsafe: the floor a fence-free copy would have);
* ``boundary``: ``DIB_TRANSFER_THREAD=0``: the import runs on the loop thread after the call in
  progress, its copy on the compute stream (the old adapter path), and the loop waits for it.

Printed, never asserted: per mode the import's wall p50/p95 and its ratio to the copy alone, split
by the kind of step in progress when it started, next to what the simulator's ``--transfers
fenced`` assumes (the rest of the GPU's decode step in progress; nothing in a prompt step), and
the loop's calls per second.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field

import torch

from bench.multi_gpu.analysis import nearest_rank
from bench.support.quick import add_quick
from rank.deepinfer_transfers import DeepInferTransfers
from rank.host_budget import SHM_DIR
from rank.host_pool import HostPool
from standins.fake_deepinfer import BlockManager

MODES = ("fenced", "unfenced", "boundary")


def _pct(values: list[float], q: float) -> float:
    return nearest_rank(values, q) if values else float("nan")  # a step kind may get no import


def cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on this GPU (measured with events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 50_000_000
    start.record()
    torch.cuda._sleep(n)  # type: ignore[attr-defined]
    end.record()
    end.synchronize()
    return n / start.elapsed_time(end)


@dataclass
class Loop:
    """The loop thread's DeepInfer-like calls; ``kind`` is the step in progress on the host."""

    transfers: DeepInferTransfers
    cycles_ms: float
    decode_ms: float
    prompt_ms: float
    prompt_every: int
    boundary: queue.Queue[tuple[threading.Event, list[float]]] | None = None
    kind: str = "decode"
    calls: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        prev: torch.cuda.Event | None = None
        scratch = torch.zeros(1, device="cuda")
        while not self.stop.is_set():
            prompt = self.prompt_every > 0 and self.calls % self.prompt_every == self.prompt_every - 1
            self.kind = "prompt" if prompt else "decode"
            torch.cuda._sleep(int((self.prompt_ms if prompt else self.decode_ms) * self.cycles_ms))  # type: ignore[attr-defined]  # forward
            if prev is not None:
                prev.synchronize()  # post-process of the previous step (ZOS)
            scratch.add_(1)  # the sample
            ended = torch.cuda.Event()
            ended.record()
            if prompt:
                ended.synchronize()  # a prompt step is post-processed in place
            prev = ended
            self.transfers.fence()  # the adapter, after every llm.step()
            self.calls += 1
            self._run_boundary_imports()

    def _run_boundary_imports(self) -> None:
        """``boundary`` mode: the imports that came during the call run now, on this thread."""
        while self.boundary is not None and not self.boundary.empty():
            done, out = self.boundary.get_nowait()
            out.append(_timed_import(self.transfers))
            done.set()


def _timed_import(transfers: DeepInferTransfers) -> float:
    ids = transfers.import_(0, transfers.host_pool.num_slots)  # type: ignore[union-attr]
    transfers.release(ids)
    return time.monotonic()


def run_mode(mode: str, args: argparse.Namespace, pool: HostPool, cycles_ms: float) -> dict[str, object]:
    rows = args.blocks * 4 + 1
    gpu = torch.zeros(rows, pool.bytes_per_block, dtype=torch.uint8, device="cuda")
    transfers = DeepInferTransfers(BlockManager(rows), lambda: gpu, rows, pool)
    if mode == "unfenced":
        transfers._fence = None
    if mode == "boundary":  # the old path: the compute stream, no fence (it synchronizes the stream)
        transfers._stream, transfers._fence = None, None
    loop = Loop(transfers, cycles_ms, args.decode_ms, args.prompt_ms, args.prompt_every,
                queue.Queue() if mode == "boundary" else None)
    thread = threading.Thread(target=loop.run, name="loop")
    thread.start()
    rng = random.Random(args.seed)
    walls: dict[str, list[float]] = {"decode": [], "prompt": []}
    time.sleep(0.5)
    calls0, t0 = loop.calls, time.monotonic()
    for _ in range(args.imports):
        time.sleep(rng.uniform(args.gap_ms[0], args.gap_ms[1]) / 1e3)
        kind, start = loop.kind, time.monotonic()
        if loop.boundary is not None:
            done, out = threading.Event(), []
            loop.boundary.put((done, out))
            done.wait()
            end = out[0]
        else:
            end = _timed_import(transfers)
        walls[kind].append((end - start) * 1e3)
    calls_per_s = (loop.calls - calls0) / (time.monotonic() - t0)
    loop.stop.set()
    thread.join()
    return {"mode": mode, "walls_ms": walls, "calls_per_s": calls_per_s}


def copy_ms(pool: HostPool, num_blocks: int) -> float:
    gpu = torch.zeros(num_blocks, pool.bytes_per_block, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    times = []
    for _ in range(20):
        t = time.monotonic()
        pool.copy_to_device(gpu, list(range(num_blocks)), 0, stream=stream)
        times.append((time.monotonic() - t) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fence_wait", description=__doc__.split("\n")[0])
    p.add_argument("--decode-ms", type=float, default=30.0, help="GPU time of a decode step")
    p.add_argument("--prompt-ms", type=float, default=400.0, help="GPU time of a prompt step")
    p.add_argument("--prompt-every", type=int, default=10, help="every Nth call is a prompt step (0: never)")
    p.add_argument("--blocks", type=int, default=54, help="blocks per import")
    p.add_argument("--block-mib", type=float, default=3.0, help="bytes per block (MiB)")
    p.add_argument("--imports", type=int, default=200, help="imports per mode")
    p.add_argument("--gap-ms", type=float, nargs=2, default=(5.0, 60.0),
                   help="pause between imports (uniform)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seed", type=int, default=0)
    add_quick(p, argv, decode_ms=2.0, prompt_ms=10.0, prompt_every=4, blocks=4, block_mib=0.25, imports=10,
              gap_ms=(1.0, 5.0))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.fence_wait needs a CUDA device")
    bytes_per_block = int(args.block_mib * (1 << 20))
    shm = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()  # CUDA pins tmpfs mappings only
    path = os.path.join(shm, f"dib-fence-{os.getpid()}")
    pool = HostPool(path, bytes_per_block * args.blocks, pin=True)
    pool.open(bytes_per_block)
    try:
        cycles_ms = cycles_per_ms()
        copy = copy_ms(pool, args.blocks)
        print(f"{torch.cuda.get_device_name()}: {args.blocks} blocks x {args.block_mib:g} MiB, copy alone "
              f"{copy:.2f} ms (median); decode step {args.decode_ms:g} ms, prompt step {args.prompt_ms:g} ms "
              f"every {args.prompt_every} calls; {args.imports} imports per mode")
        print(f"{'mode':<10}{'in step':<9}{'n':>5}{'p50 ms':>9}{'p95 ms':>9}{'p50/copy':>10}{'p95/copy':>10}"
              f"{'calls/s':>9}")
        for mode in args.modes.split(","):
            r = run_mode(mode, args, pool, cycles_ms)
            walls = r["walls_ms"]
            assert isinstance(walls, dict)
            for kind, w in walls.items():
                print(f"{mode:<10}{kind:<9}{len(w):>5}{_pct(w, 0.5):>9.2f}{_pct(w, 0.95):>9.2f}"
                      f"{_pct(w, 0.5) / copy:>10.1f}{_pct(w, 0.95) / copy:>10.1f}{r['calls_per_s']:>9.1f}")
        print(f"simulator (--transfers fenced): a decode-step import waits for the rest of the GPU's step "
              f"(uniform: mean {args.decode_ms / 2:g} ms, p95 {0.95 * args.decode_ms:g} ms) then copies; "
              "a prompt-step import copies at once")
    finally:
        pool.close()
        os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
