"""CLI of the capacity simulator (virtual time; a step takes seconds to a minute of CPU).

    python -m bench.simulator seed-table            # the seed's rows, simulated vs published
    python -m bench.simulator step --context 500000 --agents 200 --policy ours
    python -m bench.simulator capacity --context 500000 --ttft-p95 30 --policy ours
    python -m bench.simulator all --out bench/results/simulator.json   # everything above
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import orjson

from bench.loadgen.report import StepStats, format_table
from bench.simulator.agents import simulate_step
from bench.simulator.model import SimConfig
from bench.simulator.vclock import run_virtual

# The seed's published rows ("Results on 4x B200", /work/shared/seeds/000_44346cd874f649af.txt):
# (context, agents): (TTFT p50 s, TTFT p95 s, tok/s p50, tok/s p10, cache hit)
PUBLISHED: dict[tuple[int, int], tuple[float, float, float, float, float]] = {
    (128_000, 300): (5.6, 14.8, 35, 16, 0.98),
    (500_000, 50): (2.5, 4.4, 163, 100, 1.00),
    (500_000, 100): (2.6, 37.0, 135, 39, 0.99),
    (1_000_000, 48): (3.6, 28.9, 69, 22, 1.00),
}
# The seed's Limits section: 200 agents at 500K fell to a 41% hit and 151 s TTFT p50.
PUBLISHED_COLLAPSE = {(500_000, 200): (151.0, 0.41)}
TOLERANCE = 0.25


def run_one(config: SimConfig, context: int, agents: int) -> StepStats:
    t0 = time.monotonic()
    stats = run_virtual(simulate_step(config, context, agents)).stats
    print(f"  simulated {config.policy} {context // 1000}K x {agents}: {time.monotonic() - t0:.1f} s of CPU",
          file=sys.stderr, flush=True)
    return stats


def run_many(jobs: list[tuple[SimConfig, int, int]], num_procs: int) -> list[StepStats]:
    """Independent steps in parallel processes (each step is single-threaded)."""
    if num_procs <= 1 or len(jobs) <= 1:
        return [run_one(*job) for job in jobs]
    with ProcessPoolExecutor(max_workers=min(num_procs, len(jobs))) as pool:
        return list(pool.map(run_one, *zip(*jobs)))


def _within(sim: float, pub: float) -> bool:
    return abs(sim - pub) <= TOLERANCE * abs(pub)


def seed_table(config: SimConfig, num_procs: int = 2) -> tuple[list[dict[str, Any]], bool]:
    cfg = config.model_copy(update={"policy": "seed"})
    rows = []
    ok_all = True
    steps = list(PUBLISHED.items()) + [((500_000, 200), None)]
    results = run_many([(cfg, ctx, n) for (ctx, n), _pub in steps], num_procs)
    print(f"{'step':>12} | {'TTFT p50 sim/pub':>17} | {'TTFT p95 sim/pub':>17} | {'tok/s p50 sim/pub':>17} | "
          f"{'p10 sim/pub':>12} | {'cache sim/pub':>14} | within 25% (p50, hit)")
    for ((ctx, n), pub), s in zip(steps, results):
        if pub is None:
            p50, hit = PUBLISHED_COLLAPSE[(ctx, n)]
            pub_row = (p50, float("nan"), float("nan"), float("nan"), hit)
        else:
            pub_row = pub
        ok = _within(s.ttft_p50_s, pub_row[0]) and _within(s.cache_hit, pub_row[4])
        if pub is not None:
            ok_all &= ok
        print(f"{f'{ctx // 1000}K x {n}':>12} | {s.ttft_p50_s:7.1f} / {pub_row[0]:<7.1f} | "
              f"{s.ttft_p95_s:7.1f} / {pub_row[1]:<7.1f} | {s.tok_s_p50:7.0f} / {pub_row[2]:<7.0f} | "
              f"{s.tok_s_p10:5.0f} / {pub_row[3]:<4.0f} | {100 * s.cache_hit:5.1f}% / {100 * pub_row[4]:3.0f}% | "
              f"{'yes' if ok else 'NO'}{'' if pub is not None else ' (Limits section; not a fitted row)'}", flush=True)
        rows.append({"context": ctx, "agents": n, "sim": s.model_dump(exclude={"timeline"}), "published": pub_row,
                     "within_tolerance": ok})
    print(f"seed rows reproduced within {TOLERANCE:.0%} on TTFT p50 and cache hit: {'yes' if ok_all else 'NO'}")
    return rows, ok_all


def capacity(config: SimConfig, context: int, ttft_p95_s: float, lo: int, hi: int, step: int) -> tuple[int, list[StepStats]]:
    """Largest agent count (multiple of ``step``) whose TTFT p95 stays <= the target (bisection)."""
    tried: list[StepStats] = []

    def holds(n: int) -> bool:
        s = run_one(config, context, n)
        tried.append(s)
        print(f"    {n} agents: TTFT p95 {s.ttft_p95_s:.1f} s, cache {100 * s.cache_hit:.1f}%, "
              f"errors {100 * s.error_rate:.2f}% -> {'holds' if s.ttft_p95_s <= ttft_p95_s and s.error_rate < 0.01 else 'no'}",
              flush=True)
        return s.ttft_p95_s <= ttft_p95_s and s.error_rate < 0.01

    if not holds(lo):
        return 0, tried
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if holds(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.simulator", description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="simulated seconds per step")
    parser.add_argument("--warmup", type=float, default=300.0, help="simulated seconds left out of the stats")
    parser.add_argument("--jobs", type=int, default=2, help="steps simulated in parallel processes")
    parser.add_argument("--seed", type=int, default=0)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("seed-table", help="seed configuration vs the seed's published rows")
    p = sub.add_parser("step", help="one step")
    p.add_argument("--context", type=int, default=500_000)
    p.add_argument("--agents", type=int, default=200)
    p.add_argument("--policy", choices=["seed", "ours"], default="ours")
    p = sub.add_parser("capacity", help="agents held at a TTFT p95 target (bisection)")
    p.add_argument("--context", type=int, default=500_000)
    p.add_argument("--ttft-p95", type=float, default=30.0)
    p.add_argument("--policy", choices=["seed", "ours"], default="ours")
    p.add_argument("--lo", type=int, default=50)
    p.add_argument("--hi", type=int, default=400)
    p.add_argument("--step", type=int, default=25)
    p = sub.add_parser("all", help="seed table, our 500K x 200 step and the capacity answer")
    p.add_argument("--out", default=None)
    p.add_argument("--hi", type=int, default=400)
    p.add_argument("--tuned-votes", default="35,20", help="ALL,ANY prefill vote intervals (steps) for "
                   "the tuned run of ours at 500K x 200 (workload keys prefill_attempt_interval, "
                   "prefill_any_attempt_interval; DeepInfer's defaults are 70,100)")
    args = parser.parse_args(argv)
    config = SimConfig(duration_s=args.duration, warmup_s=args.warmup, seed=args.seed)
    doc: dict[str, Any] = {"config": config.model_dump(), "command": " ".join(sys.argv)}
    ok = True
    if args.cmd in ("seed-table", "all"):
        doc["seed_table"], ok = seed_table(config, args.jobs)
    if args.cmd == "step":
        s = run_one(config.model_copy(update={"policy": args.policy}), args.context, args.agents)
        print(format_table([s]))
        doc["step"] = s.model_dump(exclude={"timeline"})
    if args.cmd == "all":
        ours = config.model_copy(update={"policy": "ours"})
        s = run_one(ours, 500_000, 200)
        seed_row = next(r["sim"] for r in doc["seed_table"] if (r["context"], r["agents"]) == (500_000, 200))
        print("\n500K x 200 side by side (target for ours: cache >= 90% and TTFT p95 <= 30 s):")
        print(f"  {'':28} {'TTFT p50':>9} {'TTFT p95':>9} {'cache':>7} {'errors':>7}")
        print(f"  {'seed, published':28} {151.0:8.1f}s {'-':>9} {41.0:6.1f}% {'-':>7}")
        print(f"  {'seed, simulated (model)':28} {seed_row['ttft_p50_s']:8.1f}s {seed_row['ttft_p95_s']:8.1f}s "
              f"{100 * seed_row['cache_hit']:6.1f}% {100 * seed_row['error_rate']:6.2f}%")
        print(f"  {'ours, simulated (cache/)':28} {s.ttft_p50_s:8.1f}s {s.ttft_p95_s:8.1f}s "
              f"{100 * s.cache_hit:6.1f}% {100 * s.error_rate:6.2f}%")
        print(format_table([s]))
        met = s.cache_hit >= 0.90 and s.ttft_p95_s <= 30.0
        print(f"target met with DeepInfer's default vote intervals (70, 100): {'yes' if met else 'NO'}")
        doc["ours_500k_200"] = {"stats": s.model_dump(exclude={"timeline"}), "target_met": met}
        # Chunked prompts advance only at prefill vote points, so at 3 s pacing the TTFT tail is
        # set by the vote intervals; the backend exposes them as workload keys.
        all_steps, any_steps = (int(v) for v in args.tuned_votes.split(","))
        tuned = ours.model_copy(update={"engine": ours.engine.model_copy(update={
            "prefill_all_interval_steps": all_steps, "prefill_any_interval_steps": any_steps})})
        t = run_one(tuned, 500_000, 200)
        print(f"\nours with prefill_attempt_interval={all_steps}, prefill_any_attempt_interval={any_steps}:")
        print(format_table([t]))
        tuned_met = t.cache_hit >= 0.90 and t.ttft_p95_s <= 30.0
        print(f"target met with tuned vote intervals: {'yes' if tuned_met else 'NO'}")
        doc["ours_500k_200_tuned_votes"] = {"prefill_attempt_interval": all_steps,
                                            "prefill_any_attempt_interval": any_steps,
                                            "stats": t.model_dump(exclude={"timeline"}),
                                            "target_met": tuned_met}
        ok &= met or tuned_met
    if args.cmd in ("capacity", "all"):
        policy = getattr(args, "policy", "ours")
        ctx = getattr(args, "context", 500_000)
        target = getattr(args, "ttft_p95", 30.0)
        print(f"\ncapacity ({policy}, {ctx // 1000}K, TTFT p95 <= {target:g} s):")
        n, tried = capacity(config.model_copy(update={"policy": policy}), ctx, target,
                            getattr(args, "lo", 50), args.hi, getattr(args, "step", 25))
        print(f"capacity: {n} agents at {ctx // 1000}K hold TTFT p95 <= {target:g} s (seed's simulator claim: 400)")
        doc["capacity"] = {"policy": policy, "context": ctx, "ttft_p95_s": target, "agents": n,
                           "tried": [t.model_dump(exclude={"timeline"}) for t in tried]}
    if getattr(args, "out", None):
        with open(args.out, "wb") as fh:
            fh.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY))
        print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
