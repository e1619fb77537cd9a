"""Rank-layer benchmark: reference engine tokens/s on CPU, and rank IPC overhead per step.

    python -m bench.rank_bench                 # everything, defaults below
    python -m bench.rank_bench --skip-ipc      # engine only
    python -m bench.rank_bench --ranks 4 --seqs 512 --steps 200
    python -m bench.rank_bench --quick         # 'null' model, 2 ranks x 16 seqs x 20 steps, 8 L1 blocks

Figures are printed, never asserted. The reference model's weights are random (its text is
meaningless); what is measured is the cost of its math and of the serving plumbing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time

import numpy as np
import torch

from bench.support.quick import add_quick
from rank.engine import EngineRequest, SamplingParams
from rank.reference_engine import ReferenceEngine, ReferenceEngineConfig


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_engine(model: str, threads: int, prompt_len: int, num_prompts: int, decode_seqs: int,
                 decode_steps: int,
                 device: str = "cpu") -> None:
    torch.set_num_threads(threads)
    cfg = ReferenceEngineConfig(model=model, block_size=128, num_blocks=1024, max_num_seqs=256,
                                max_num_batched_tokens=4096, device=device)
    engine = ReferenceEngine(cfg)
    rng = np.random.default_rng(0)

    def prompts(n: int, length: int, max_tokens: int) -> list[EngineRequest]:
        return [EngineRequest(f"p{i}-{time.monotonic_ns()}",
                              rng.integers(3, 129_280, length).astype(np.int32),
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True), keep_blocks=False)
                for i in range(n)]

    for request in prompts(num_prompts, prompt_len, 1):
        engine.add(request)
    _sync(device)
    started = time.perf_counter()
    while engine.has_work():
        engine.step()
    _sync(device)
    prefill_s = time.perf_counter() - started
    for request in prompts(decode_seqs, 32, decode_steps + 1):
        engine.add(request)
    while engine.stats().waiting_tokens:  # finish the prefill first
        engine.step()
    engine.step()  # the first decode step (alternation) before timing
    _sync(device)
    started = time.perf_counter()
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    _sync(device)
    decode_s = time.perf_counter() - started
    math = "exact batch-invariant math" if device == "cpu" else "batched kernels, bf16"
    print(f"reference engine '{model}' ({engine.spec.num_params() / 1e6:.0f}M params) on {device} "
          f"({threads} thread(s), {math}):")
    print(f"  prefill: {num_prompts} x {prompt_len} tokens in {prefill_s:.2f}s = "
          f"{num_prompts * prompt_len / prefill_s:,.0f} tokens/s")
    print(f"  decode:  {decode_seqs} seqs x {steps} steps in {decode_s:.2f}s = "
          f"{decode_seqs * steps / decode_s:,.0f} tokens/s "
          f"({decode_s / steps * 1e3:.1f} ms/step)")
    engine.check_accounting()
    engine.close()


def bench_host_pool(model: str, device: str, num_blocks: int) -> None:
    """Export/import of ``num_blocks`` blocks through the shared pinned L1 pool vs one contiguous copy."""
    from rank.host_budget import host_pool_path, unlink_host_pool
    from rank.host_pool import HostPool

    path = host_pool_path(f"bench-{os.getpid()}")
    unlink_host_pool(path)
    engine = ReferenceEngine(ReferenceEngineConfig(model=model, block_size=128, num_blocks=num_blocks + 8,
                                                   device=device))
    pool = HostPool(path, (num_blocks + 1) * engine.bytes_per_block)
    pool.open(engine.bytes_per_block)
    try:
        ids = engine.blocks.allocate(num_blocks, cache_ref=True)
        rng = np.random.default_rng(0)
        order = rng.permutation(ids).tolist()  # blocks scattered over the pool, as in a real session
        engine.pool.random_(0, 255)
        nbytes = num_blocks * engine.bytes_per_block
        assert pool.tensor is not None
        for _ in range(2):
            pool.copy_from_device(engine.pool, order, 0)
            pool.copy_to_device(engine.pool, order, 0)
        timings = {}
        for name, fn in (
            ("export (gather + 1 copy)", lambda: pool.copy_from_device(engine.pool, order, 0)),
            ("import (1 copy + scatter)", lambda: pool.copy_to_device(engine.pool, order, 0)),
            ("contiguous pinned -> device copy",
             lambda: engine.pool[:num_blocks].copy_(pool.tensor[:num_blocks], non_blocking=True)),
        ):
            best = float("inf")
            for _ in range(5):
                _sync(device)
                t = time.perf_counter()
                fn()
                _sync(device)
                best = min(best, time.perf_counter() - t)
            timings[name] = best
        print(f"L1 host pool ({'pinned' if pool.pinned else 'pageable'}), {num_blocks} blocks x "
              f"{engine.bytes_per_block} bytes = {nbytes / 1e6:.0f} MB, best of 5:")
        for name, seconds in timings.items():
            print(f"  {name:34s} {seconds * 1e3:7.2f} ms  {nbytes / seconds / 1e9:6.1f} GB/s")
        engine.blocks.decref(ids, cache_ref=True)
    finally:
        pool.close()
        unlink_host_pool(path)
        engine.close()


def null_step_time_s(seqs_per_rank: int, steps: int) -> float:
    """In-process cost of one null-engine decode step for one rank's batch (no IPC)."""
    engine = ReferenceEngine(ReferenceEngineConfig(model="null", block_size=128, num_blocks=4096,
                                                   max_num_seqs=seqs_per_rank, max_num_batched_tokens=65536))
    for i in range(seqs_per_rank):
        engine.add(EngineRequest(f"n{i}", np.arange(3, 67, dtype=np.int32),
                                 SamplingParams(steps + 10, ignore_eos=True), keep_blocks=False))
    engine.step()
    engine.step()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - started) / steps


async def bench_ipc(num_ranks: int, num_seqs: int, steps: int) -> None:
    from rank.group import RankGroup
    from server.config import WorkloadConfig

    per_rank = num_seqs // num_ranks
    cfg = WorkloadConfig(reference_model="null", ep=num_ranks, block_size=128, reference_num_blocks=4096,
                         max_num_seqs=max(per_rank, 1), max_num_batched_tokens=65536, l1_host_gb=0.01)
    group = RankGroup(cfg.rank_config())
    await group.start()
    try:
        received = [0]

        async def consume(rank: int, i: int) -> None:
            stream = group.submit(rank, EngineRequest(f"s{i}", np.arange(3, 67, dtype=np.int32),
                                                      SamplingParams(max_tokens=steps, ignore_eos=True),
                                                      keep_blocks=False))
            async for out in stream:
                received[0] += len(out.token_ids)

        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(consume(i % num_ranks, i) for i in range(num_seqs)))
        wall_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        await group.close()
    engine_step_s = null_step_time_s(per_rank, min(steps, 100))
    step_s = wall_s / steps
    print(f"rank IPC, null model, {num_seqs} running sequences over {num_ranks} rank processes (lockstep, "
          "gloo):")
    print(f"  {steps} steps in {wall_s:.2f}s = {steps / wall_s:.1f} steps/s, {received[0] / wall_s:,.0f} "
          "tokens/s delivered to streams")
    print(f"  per step: {step_s * 1e3:.2f} ms wall; in-process null engine step for {per_rank} seqs: "
          f"{engine_step_s * 1e3:.2f} ms;"
          f" IPC + lockstep overhead {max(0.0, step_s - engine_step_s) * 1e3:.2f} ms/step")
    print(f"  backend process CPU: {cpu_s / steps * 1e3:.2f} ms per group step "
          f"({cpu_s / received[0] * 1e6:.1f} us per token)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.rank_bench")
    p.add_argument("--model", default="tiny")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--decode-seqs", type=int, default=32)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--seqs", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--host-pool-blocks", type=int, default=0,
                   help="also time L1 export/import of this many blocks")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-ipc", action="store_true")
    add_quick(p, argv, model="null", prompt_len=64, num_prompts=2, decode_seqs=4, decode_steps=4, ranks=2,
              seqs=16, steps=20, host_pool_blocks=8)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    if not args.skip_engine:
        bench_engine(args.model, args.threads, args.prompt_len, args.num_prompts, args.decode_seqs,
                     args.decode_steps, args.device)
    if args.host_pool_blocks:
        bench_host_pool(args.model, args.device, args.host_pool_blocks)
    if not args.skip_ipc:
        asyncio.run(bench_ipc(args.ranks, args.seqs, args.steps))


if __name__ == "__main__":
    main()
