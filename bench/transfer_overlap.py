"""An L1 restore's round trip against the copy of its bytes, while a rank steps.

    python -m bench.transfer_overlap                        # CPU, reference 'small', both modes
    python -m bench.transfer_overlap --device cuda --model medium --block-size 128 --blocks 54 \
        --load 16 --load-tokens 32768 --l1-gb 4
    python -m bench.transfer_overlap --quick                # CPU, 'null' model, 6 restores of 8 blocks

One rank process (``RankGroup``) keeps decoding ``--load`` long requests, so a step is always in
progress; meanwhile the benchmark restores one session of ``--blocks`` blocks from L1
(``import_blocks``, timed as the backend sees it: send to reply) ``--restores`` times, and
releases it after each one (not timed). The same restore's copy alone (``HostPool.copy_to_device``
on this process's own pool of the engine's row size) is the reference. Two modes, one group each:

* ``thread``: the worker's transfer thread runs the import beside the step (``rank/transfers.py``);
* ``loop``: ``DIB_TRANSFER_THREAD=0``, the import waits for the step boundary (the old path).

``--fold``: instead, one group (transfer thread on) serves turns that restore their prefix,
alternating the awaited restore (``import_blocks``, then the add) with the restore folded into
the add (``EngineRequest.fold``, ``rank/transfers.py``). Printed for each: the restore's wall
(awaited: send to reply, as ``bench.multi_gpu_run`` times it, which leaves out the add sent
after it; folded: the add's send to the import's end on the rank, from ``RankGroup.transfer_log``
op "fold") against the copy, and the turn's first token after the restore began.

Printed, not asserted: the step time (p50 of the intervals between one request's tokens), the
copy time (median), the round trip's p50/p95 with its ratio to the copy, and the round trip split
by phase (``RankGroup.transfer_log``: to the rank, wait, engine call, back, resume). On CPU the rank and
this process share the cores, so only the ratio between the modes means much there.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch

from bench.multi_gpu.analysis import nearest_rank, phase_table
from bench.support.quick import add_quick
from rank.client import RequestStream
from rank.engine import EngineRequest, FoldedImport, SamplingParams
from rank.group import RankGroup
from rank.host_budget import SHM_DIR
from rank.host_pool import HostPool
from rank.ids import HostSlot, Rank
from rank.link import TransferTiming
from rank.transfers import ENABLE_ENV
from server.config import WorkloadConfig

RANK, SLOT = Rank(0), HostSlot(0)


def copy_seconds(bytes_per_block: int, num_blocks: int, device: str, repeats: int = 20) -> float:
    """Median time of the restore's copy alone (the same ``HostPool`` path, no rank)."""
    # /dev/shm, as the product's pool (rank/host_budget.py): CUDA cannot pin a disk file's mapping.
    path = os.path.join(SHM_DIR if device == "cuda" else tempfile.gettempdir(), f"dib-overlap-{os.getpid()}")
    pool = HostPool(path, bytes_per_block * num_blocks)
    try:
        pool.open(bytes_per_block)
        dev = torch.device(device)
        rows = torch.zeros(2 * num_blocks + 1, bytes_per_block, dtype=torch.uint8, device=dev)
        ids = list(range(1, 2 * num_blocks + 1, 2))  # scattered rows, as in a used pool
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            pool.copy_to_device(rows, ids, 0)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        pool.close()
        os.unlink(path)


async def run_mode(args: argparse.Namespace, thread: bool) -> dict[str, Any]:
    bs = args.block_size
    load_blocks = args.load * (-(-(args.load_tokens + 4096) // bs))  # prompt + room to decode
    config = WorkloadConfig(reference_model=args.model, reference_device=args.device, ep=1, block_size=bs,
                            reference_num_blocks=args.blocks * 4 + load_blocks + 64,
                            max_num_batched_tokens=16384, l1_host_gb=args.l1_gb)
    env = {**os.environ, ENABLE_ENV: "1" if thread else "0"}
    group = RankGroup(config.rank_config(), base_env=env)
    await group.start()
    try:
        prompt = np.arange(3, 3 + args.blocks * bs + 1, dtype=np.int32) % 1000 + 3
        stream = group.submit(RANK, EngineRequest("session", prompt, SamplingParams(max_tokens=1)))
        kept = [out async for out in stream][-1].kept_blocks
        await group.export_blocks(RANK, kept, SLOT)
        await group.release(RANK, kept)
        n = len(kept)
        load = [group.submit(RANK, EngineRequest(f"load{i}", np.arange(3, 3 + args.load_tokens + i,
                                                                        dtype=np.int32) % 1000 + 3,
                                                 SamplingParams(max_tokens=4096, ignore_eos=True)))
                for i in range(args.load)]
        arrivals: list[float] = []

        async def watch() -> None:
            async for _ in load[0]:
                arrivals.append(time.perf_counter())

        watcher = asyncio.ensure_future(watch())
        walls = []
        measured_from = float("inf")
        for i in range(args.warmup + args.restores):
            if i == args.warmup:
                measured_from = time.monotonic()  # TransferTiming.sent is on this clock
            await asyncio.sleep(random.uniform(0.0, 2 * args.gap_ms / 1e3))  # land anywhere in a step
            start = time.perf_counter()
            ids = await group.import_blocks(RANK, SLOT, n)
            walls.append(time.perf_counter() - start)
            await group.release(RANK, ids)
        walls = walls[args.warmup:]
        for i in range(args.load):
            group.abort(RANK, f"load{i}")
        await asyncio.wait_for(watcher, 60)

        async def drain(s: RequestStream) -> None:
            async for _ in s:
                pass

        await asyncio.wait_for(asyncio.gather(*(drain(s) for s in load[1:])), 60)
        steps = [b - a for a, b in itertools.pairwise(arrivals)]
        phases = phase_table(group.transfer_log, "import", measured_from)
        return {"phases": phases, "blocks": n, "bytes_per_block": group.bytes_per_block,
                "step_p50": nearest_rank(steps, 0.5), "wall_p50": nearest_rank(walls, 0.5),
                "wall_p95": nearest_rank(walls, 0.95)}
    finally:
        await group.close()


async def run_fold_ab(args: argparse.Namespace) -> dict[str, Any]:
    """``--fold``: turns that restore a spilled session, awaited and folded alternately."""
    bs = args.block_size
    load_blocks = args.load * (-(-(args.load_tokens + 4096) // bs))
    config = WorkloadConfig(reference_model=args.model, reference_device=args.device, ep=1, block_size=bs,
                            reference_num_blocks=args.blocks * 6 + load_blocks + 64,
                            max_num_batched_tokens=16384, l1_host_gb=args.l1_gb)
    group = RankGroup(config.rank_config(), base_env={**os.environ, ENABLE_ENV: "1"})
    await group.start()
    try:
        session = np.arange(3, 3 + args.blocks * bs + 1, dtype=np.int32) % 1000 + 3
        stream = group.submit(RANK, EngineRequest("session", session, SamplingParams(max_tokens=1)))
        kept = [out async for out in stream][-1].kept_blocks
        await group.export_blocks(RANK, kept, SLOT)
        await group.release(RANK, kept)
        n = len(kept)
        prompt = np.concatenate([session[: n * bs], np.arange(7, 7 + bs, dtype=np.int32)])  # n usable blocks
        load = [group.submit(RANK, EngineRequest(f"load{i}", np.arange(3, 3 + args.load_tokens + i,
                                                                        dtype=np.int32) % 1000 + 3,
                                                 SamplingParams(max_tokens=4096, ignore_eos=True)))
                for i in range(args.load)]
        walls: dict[str, list[float]] = {"awaited": [], "folded": []}
        firsts: dict[str, list[float]] = {"awaited": [], "folded": []}
        measured_from = float("inf")
        for i in range(2 * (args.warmup + args.restores)):
            if i == 2 * args.warmup:
                measured_from = time.monotonic()
            await asyncio.sleep(random.uniform(0.0, 2 * args.gap_ms / 1e3))  # land anywhere in a step
            mode = "folded" if i % 2 else "awaited"
            sampling = SamplingParams(max_tokens=1)
            start = time.perf_counter()
            fold = None
            if mode == "awaited":
                ids = await group.import_blocks(RANK, SLOT, n)
                walls[mode].append(time.perf_counter() - start)
                turn = group.submit(RANK, EngineRequest(f"t{i}", prompt, sampling, list(ids), n * bs))
            else:
                fold = FoldedImport(SLOT, n, 0, 0, asyncio.get_running_loop().create_future())
                turn = group.submit(RANK, EngineRequest(f"t{i}", prompt, sampling, [], n * bs, True, fold))
            outs = [out async for out in turn]
            if i >= 2 * args.warmup:
                firsts[mode].append(time.perf_counter() - start)
            if fold is not None:
                ids = await fold.reply
            await group.release(RANK, list(ids))
            await group.release(RANK, list(outs[-1].kept_blocks))
        for i in range(args.load):
            group.abort(RANK, f"load{i}")
        for s in load:
            async for _ in s:
                pass
        folded = [t.to_rank_s + t.wait_s + t.engine_s for t in group.transfer_log
                  if t.op == "fold" and t.sent >= measured_from]
        return {"blocks": n, "bytes_per_block": group.bytes_per_block,
                "awaited": walls["awaited"][args.warmup:], "folded": folded, "firsts": firsts}
    finally:
        await group.close()


def print_fold_ab(args: argparse.Namespace, r: dict[str, Any]) -> None:
    copy = copy_seconds(int(r["bytes_per_block"]), int(r["blocks"]), args.device)
    print(f"copy {copy * 1e3:.3f} ms ({r['blocks'] * r['bytes_per_block'] / 2**20:.2f} MiB); "
          f"restores of each kind: {len(r['awaited'])}")
    for mode in ("awaited", "folded"):
        w, f = r[mode], r["firsts"][mode]
        p50, p95 = nearest_rank(w, 0.5), nearest_rank(w, 0.95)
        print(f"{mode:>8}: restore wall p50 {p50 * 1e3:6.3f} ms ({p50 / copy:5.2f}x copy), p95 "
              f"{p95 * 1e3:6.3f} ms ({p95 / copy:5.2f}x copy) | restore start -> turn's token p50 "
              f"{nearest_rank(f, 0.5) * 1e3:7.2f} ms, p95 {nearest_rank(f, 0.95) * 1e3:7.2f} ms")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per restore")
    parser.add_argument("--load", type=int, default=4, help="long requests decoding meanwhile")
    parser.add_argument("--load-tokens", type=int, default=200, help="prompt tokens of each of them")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--l1-gb", type=float, default=0.25)
    parser.add_argument("--restores", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=25.0, help="mean pause between restores")
    parser.add_argument("--mode", choices=["both", "thread", "loop"], default="both")
    parser.add_argument("--fold", action="store_true",
                        help="awaited against folded restores, alternating, in turns (module docstring)")
    add_quick(parser, argv, model="null", device="cpu", blocks=8, load=2, load_tokens=64, l1_gb=0.02,
              restores=6, warmup=1, gap_ms=5.0)
    args = parser.parse_args(argv)
    modes = [True, False] if args.mode == "both" else [args.mode == "thread"]
    print(f"reference '{args.model}' on {args.device}, {args.load} decoding requests, restores of "
          f"{args.blocks} blocks x {args.block_size} tokens")
    if args.fold:
        print_fold_ab(args, asyncio.run(run_fold_ab(args)))
        return
    for thread in modes:
        r = asyncio.run(run_mode(args, thread))
        copy = copy_seconds(int(r["bytes_per_block"]), int(r["blocks"]), args.device)
        print(f"{'thread' if thread else 'loop':>6}: step p50 {r['step_p50'] * 1e3:7.2f} ms | copy "
              f"{copy * 1e3:6.2f} ms ({r['blocks'] * r['bytes_per_block'] / 2**20:.1f} MiB) | round trip "
              f"p50 {r['wall_p50'] * 1e3:7.2f} ms ({r['wall_p50'] / copy:5.1f}x copy), p95 "
              f"{r['wall_p95'] * 1e3:7.2f} ms ({r['wall_p95'] / copy:5.1f}x copy)")
        phases = r["phases"]
        print("        round trip by phase, ms p50 / p95 (rank/link.py TransferTiming): " + ", ".join(
            f"{name.removesuffix('_s').replace('_', ' ')} {phases[name]['p50'] * 1e3:.2f} / "
            f"{phases[name]['p95'] * 1e3:.2f}" for name in TransferTiming.PHASES))


if __name__ == "__main__":
    main()
