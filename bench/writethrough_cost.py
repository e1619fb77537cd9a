"""What writing every finished turn through to L1 (and L2) costs at the seed's 500K x 200.

The capacity simulator (``bench/simulator``: the real ``cache/`` code over a modelled 4-rank
DeepInfer group, virtual time) runs the same agents twice in one invocation, once with the
write-through after every turn (``l1_write_watermark`` 0, the default) and once with it off (1.0:
only evicted sessions are exported). Exports share each rank's copy path with restores in the
model (one copy at a time per rank, at the deployment's restore rate), so a write-through that
held up a restore shows in the TTFT. Printed per run: the blocks exported per second in the
measured window, the bytes at V4.1-Flash's geometry (891 B of KV per token, 128-token blocks =
114,048 B per block) against the host link and the local disk's save rate, the TTFT p50 / p95
and the cache hit.

    python -m bench.writethrough_cost                       # 500K x 200, 600 s (300 s warm-up)
    python -m bench.writethrough_cost --agents 100 --duration 300
    python -m bench.writethrough_cost --quick               # 20K x 4, 60 s simulated (seconds)
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from bench.simulator.agents import simulate_step
from bench.simulator.engine import SimGroup
from bench.simulator.model import OursPolicy, SimConfig
from bench.simulator.vclock import run_virtual
from bench.support.quick import add_quick

V41_BYTES_PER_BLOCK = 891 * 128  # docs/tiers.md: 114,048 B per 128-token block
LINK_GBPS = 45.0  # host <-> GPU per H200, measured (docs/cache.md, L1 restore)
DISK_SAVE_GBPS = 2.04  # the H200 host's local L2 save rate, 4 I/O threads (docs/tiers.md)


def run(context: int, agents: int, duration_s: float, watermark: float) -> dict[str, Any]:
    config = SimConfig(policy="ours", ours=OursPolicy(cache={"l1_write_watermark": watermark}),
                       duration_s=duration_s, warmup_s=duration_s / 2)
    exported = [0]
    original = SimGroup.export_blocks

    async def counting(self: SimGroup, rank: int, block_ids: list[int], host_slot: int) -> None:
        if asyncio.get_running_loop().time() >= config.warmup_s:
            exported[0] += len(block_ids)
        await original(self, rank, block_ids, host_slot)

    SimGroup.export_blocks = counting  # type: ignore[method-assign]
    try:
        result = run_virtual(simulate_step(config, context, agents))
    finally:
        SimGroup.export_blocks = original  # type: ignore[method-assign]
    window_s = config.duration_s - config.warmup_s
    s = result.stats
    blocks_per_s = exported[0] / window_s
    return {"watermark": watermark, "blocks_per_s": blocks_per_s,
            "bytes_per_s": blocks_per_s * V41_BYTES_PER_BLOCK, "ttft_p50_s": s.ttft_p50_s,
            "ttft_p95_s": s.ttft_p95_s, "cache_hit": s.cache_hit, "requests": s.num_requests}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=500_000)
    p.add_argument("--agents", type=int, default=200)
    p.add_argument("--duration", type=float, default=600.0)
    add_quick(p, argv, context=20_000, agents=4, duration=60.0)
    args = p.parse_args(argv)
    print(f"{args.context // 1000}K x {args.agents}, {args.duration:g} s simulated (second half measured); "
          f"V4.1-Flash {V41_BYTES_PER_BLOCK:,} B per block")
    rows = [run(args.context, args.agents, args.duration, w) for w in (0.0, 1.0)]
    for r in rows:
        name = "write-through every turn" if r["watermark"] == 0.0 else "write-through off      "
        mb_s = r["bytes_per_s"] / 1e6
        print(f"  {name}: {r['blocks_per_s']:8.1f} blocks/s exported = {mb_s:7.1f} MB/s for the node "
              f"({100 * mb_s / 1e3 / (4 * LINK_GBPS):.3f}% of 4 x {LINK_GBPS:g} GB/s host links, "
              f"{100 * mb_s / 1e3 / DISK_SAVE_GBPS:.1f}% of a {DISK_SAVE_GBPS:g} GB/s disk); TTFT p50 "
              f"{r['ttft_p50_s']:.2f} s, p95 {r['ttft_p95_s']:.2f} s; hit {100 * r['cache_hit']:.1f}%; "
              f"{r['requests']} turns")
    on, off = rows
    print(f"  write-through: TTFT p50 {on['ttft_p50_s'] - off['ttft_p50_s']:+.2f} s, "
          f"p95 {on['ttft_p95_s'] - off['ttft_p95_s']:+.2f} s; "
          f"+{(on['bytes_per_s'] - off['bytes_per_s']) / 1e6:.1f} MB/s exported")


if __name__ == "__main__":
    main()
