"""CPU cost of ``CacheManager.admit`` + ``finish`` with many known sessions (no engine).

    python -m bench.admit_bench                          # 1,024 sessions, 4 ranks, 4 rounds
    python -m bench.admit_bench --sessions 4096 --profile
    python -m bench.admit_bench --quick                  # 32 sessions, 2 ranks, 2 rounds (seconds)

The cache's bookkeeping per turn (hash, session lookup, routing with the load measure, pin,
reserve, gauges; then filing the kept blocks) runs against a stand-in rank client that has
room for everything and answers releases at once, so what is measured is the manager's own
work, with Prometheus metrics on as in the server. Round 1 creates the sessions (every turn is
a new session); later rounds are returning turns of the same sessions (by their hint) while the
others sit idle, which is the serving benchmark's second round. Printed: CPU microseconds per
admit and per finish (``time.process_time``, less sensitive to a loaded machine than wall time)
and the load average; then the CPU of one ``loads()`` (the router's load measure) against the
walk over every session that it replaced (``IdleLoad.check``).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import time
from collections.abc import Callable

import numpy as np
from prometheus_client import CollectorRegistry

from bench.support.quick import add_quick
from cache.config import CacheConfig
from cache.manager import CacheManager
from cache.metrics import CacheMetrics
from cache.sessions import StopKind
from rank.client import GroupState
from rank.engine import EngineStats, FinishReason, RequestOutput


class _StandInClient:
    """Just enough of ``RankClient`` for admission: geometry, releases, no host pool."""

    def __init__(self, num_ranks: int, num_blocks: int, block_size: int) -> None:
        self.num_ranks = num_ranks
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.bytes_per_block = 512
        self.num_host_slots = 0
        self.prefix_cache_supported = True
        self.prefix_cache_reason: str | None = None
        self.epoch = 1
        self.state = GroupState.READY
        self._next_block = 1

    def add_restart_listener(self, fn: Callable[[int], None]) -> None:
        pass

    def new_blocks(self, n: int) -> list[int]:
        first = self._next_block
        self._next_block += n
        return list(range(first, first + n))

    async def release(self, rank: int, block_ids: list[int]) -> None:
        return None

    def stats(self, rank: int) -> EngineStats:
        return EngineStats(self.num_blocks, self.num_blocks - 1, 0, 0, 0, 0, 0, 0, 0)


async def run(num_sessions: int, num_ranks: int, rounds: int, prompt_tokens: int, output_tokens: int,
              profile: bool) -> None:
    bs = 128
    turn_blocks = -(-(prompt_tokens + output_tokens * rounds + 16 * rounds) // bs) + 1
    client = _StandInClient(num_ranks, num_sessions * turn_blocks // num_ranks * 2 + 64, bs)
    mgr = CacheManager(client, CacheConfig(l1_cache=False),
                       CacheMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 129_000, prompt_tokens).astype(np.int32) for _ in range(num_sessions)]
    profiler = cProfile.Profile() if profile else None
    for round_no in range(rounds):
        admit_cpu_s = finish_cpu_s = 0.0
        if profiler is not None and round_no == rounds - 1:
            profiler.enable()
        for i in range(num_sessions):
            t0 = time.process_time()
            adm = await mgr.admit(prompts[i], f"s{i}", output_tokens)
            t1 = time.process_time()
            out_ids = rng.integers(3, 129_000, output_tokens).astype(np.int32)
            num_tokens = len(prompts[i]) + output_tokens
            kept = client.new_blocks((num_tokens - 1) // bs)
            last = RequestOutput(f"r{i}", [int(out_ids[-1])], True, FinishReason.LENGTH, len(prompts[i]),
                                 adm.num_cached_tokens, kept)
            t2 = time.process_time()
            mgr.finish(adm, prompts[i], out_ids, last, StopKind.TOOL_USE)
            t3 = time.process_time()
            admit_cpu_s += t1 - t0
            finish_cpu_s += t3 - t2
            prompts[i] = np.concatenate([prompts[i], out_ids, rng.integers(3, 129_000, 16).astype(np.int32)])
        if profiler is not None and round_no == rounds - 1:
            profiler.disable()
        await mgr.drain()
        kind = "new sessions" if round_no == 0 else f"returning turns, {len(mgr.sessions)} sessions known"
        print(f"round {round_no + 1} ({kind}): admit {admit_cpu_s / num_sessions * 1e6:.1f} us CPU, "
              f"finish {finish_cpu_s / num_sessions * 1e6:.1f} us CPU per turn "
              f"(load average {os.getloadavg()[0]:.1f})")

    num_calls = 2000
    t0 = time.process_time()
    for _ in range(num_calls):
        mgr.loads()
    loads_s = (time.process_time() - t0) / num_calls
    t0 = time.process_time()
    for _ in range(num_calls // 20):
        mgr.idle_load.check(time.monotonic())  # the old walk over every session (+ one loads-like query)
    walk_s = (time.process_time() - t0) / (num_calls // 20)
    print(f"loads(): {loads_s * 1e6:.1f} us CPU; the walk over all {len(mgr.sessions)} sessions it replaced: "
          f"{walk_s * 1e6:.1f} us CPU")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(18)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.admit_bench", description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=1024)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="cProfile the last round")
    add_quick(p, argv, sessions=32, ranks=2, rounds=2)
    args = p.parse_args(argv)
    asyncio.run(run(args.sessions, args.ranks, args.rounds, args.prompt_tokens, args.output_tokens,
                    args.profile))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
