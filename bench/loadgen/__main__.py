"""CLI of the agent load generator.

    python -m bench.loadgen run --url http://127.0.0.1:8000 --context 128000 --agents 50,100,200 \
        --duration 600 --warmup 120 --out bench/results/run.json --charts bench/results/run
    python -m bench.loadgen cold-start --url ... --conversations 397 --context 440000
    python -m bench.loadgen cache-check --url ... --sizes 16000,64000,200000
    python -m bench.loadgen compare a.json b.json
    python -m bench.loadgen charts run.json --out dir
    python -m bench.loadgen run --quick     # 2 agents, 8K context, 4 s, against bench.loadgen.fake_server

``run --quick`` without ``--url`` starts the fake server (``bench/loadgen/fake_server.py``) in a
child process for the run: the load generator end to end in seconds, no backend needed.

See docs/loadtest.md for the defaults and where they come from.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from bench.loadgen import fake_server
from bench.loadgen.distributions import TraceError, WorkloadParams, make_turn_source
from bench.loadgen.report import (
    Criteria,
    compare,
    format_table,
    load_json,
    save_json,
    step_stats,
    write_charts,
)
from bench.loadgen.runner import RunConfig, run_cold_start, run_step
from bench.loadgen.textgen import TextSynth
from bench.support.quick import add_quick


def _ints(text: str) -> list[int]:
    try:
        values = [int(float(v)) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("numbers must be >= 1")
    return values


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="backend base URL (no /v1)")
    p.add_argument("--model", default="deepseek-v4.1-flash")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="per-request limit, s")


def _workload(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", type=int, default=128_000,
                   help="context target, tokens (128000, 500000, 1000000)")
    p.add_argument("--pacing", type=float, default=3.0, help="seconds between a response and the next turn")
    p.add_argument("--pacing-dist", choices=["constant", "lognormal"], default="constant")
    p.add_argument("--size-scale", type=float, default=1.0,
                   help="multiply per-turn sizes (CPU engine: 0.05-0.2)")
    p.add_argument("--start-fraction", default="0.4,0.6",
                   help="initial context as a share of the target: lo,hi")
    p.add_argument("--trace", default=None, help="JSONL trace replacing the per-step distributions")
    p.add_argument("--no-system-message", action="store_true",
                   help="omit the mid-conversation system message")
    p.add_argument("--subagents", choices=["off", "light", "heavy"], default="light",
                   help="subagent fan-outs under the parent's session id with an x-claude-code-agent-id "
                   "(bench/loadgen/subagents.py): light (3%% of conversations spawn, as in public Claude "
                   "Code traces), heavy (~40%% of requests, as in corpora chosen for subagents), off")


def _params(args: argparse.Namespace) -> WorkloadParams:
    lo, hi = (float(v) for v in args.start_fraction.split(","))
    return WorkloadParams(
        context_target_tokens=args.context,
        pacing=args.pacing_dist,
        pacing_s=args.pacing,
        size_scale=args.size_scale,
        start_fraction_min=lo,
        start_fraction_max=hi,
    )


def _config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        base_url=args.url,
        model=args.model,
        api_key=args.api_key,
        seed=args.seed,
        request_timeout_s=args.timeout,
        mid_conversation_system=not getattr(args, "no_system_message", False),
        subagents=getattr(args, "subagents", "light"),
    )


def cmd_run(args: argparse.Namespace) -> int:
    if args.url is None:
        with fake_server.running() as url:
            args.url = url
            return cmd_run(args)
    params = _params(args)
    source = make_turn_source(params, args.trace)
    synth = TextSynth()
    config = _config(args)
    config.duration_s, config.warmup_s, config.ramp_s, config.drain_s = (
        args.duration, args.warmup, args.ramp, args.drain)
    criteria = Criteria()
    steps = []
    for idx, num_agents in enumerate(args.agents):
        label = f"step {idx + 1}/{len(args.agents)} {args.context // 1000}K x {num_agents}"
        records, t_from, t_to = asyncio.run(run_step(params, source, synth, config, num_agents, label))
        stats = step_stats(label, args.context, num_agents, records, t_from, t_to, criteria)
        steps.append(stats)
        print(format_table([stats]).splitlines()[-1], flush=True)
        if stats.errors_sample:
            print("  errors:", *stats.errors_sample, sep="\n    ")
        if idx + 1 < len(args.agents) and args.pause > 0:
            time.sleep(args.pause)
    print()
    print(format_table(steps))
    for s in steps:
        print(f"steady-state cache hit at {s.num_agents} agents: {100 * s.cache_hit:.1f}% "
              f"(incl. warm-up {100 * s.cache_hit_all:.1f}%)")
    meta = {
        "command": " ".join(sys.argv),
        "url": args.url,
        "params": params.model_dump(),
        "trace": args.trace,
        "subagents": args.subagents,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "criteria": criteria.model_dump(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if args.out:
        save_json(args.out, meta, steps)
        print(f"wrote {args.out}")
    if args.charts:
        for path in write_charts(steps, args.charts,
                                 f"{args.context // 1000}K context, {args.pacing:g} s pacing", criteria):
            print(f"wrote {path}")
    return 0 if all(s.num_errors == 0 or s.error_rate < 1 for s in steps) else 1


def cmd_cold_start(args: argparse.Namespace) -> int:
    params = _params(args)
    synth = TextSynth()
    config = _config(args)
    records, wall_s = asyncio.run(run_cold_start(params, synth, config, args.conversations, args.context,
                                                 args.max_tokens))
    ok = [r for r in records if r.error is None]
    total = sum(r.total_input_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    print(f"cold start: {len(records)} conversations of ~{args.context} tokens, {len(records) - len(ok)} "
          "errors")
    print(f"  wall {wall_s:.1f} s, {total:,} input tokens ({total / wall_s:,.0f} tok/s), "
          f"cached {sum(r.cached_tokens for r in ok):,}")
    if ttfts:
        print(f"  TTFT p50 {np.quantile(ttfts, 0.5):.2f} s, p95 {np.quantile(ttfts, 0.95):.2f} s, max "
              f"{max(ttfts):.2f} s")
    for err in sorted({r.error for r in records if r.error})[:5]:
        print("  error:", err)
    return 0 if len(ok) == len(records) else 1


def cmd_cache_check(args: argparse.Namespace) -> int:
    from bench.loadgen.cache_check import run_cache_check

    synth = TextSynth()
    config = _config(args)
    results = asyncio.run(run_cache_check(synth, config, args.sizes, args.depth, args.max_tokens))
    print(f"{'tokens':>8} | cold | repeat | cached | identical | fact")
    for res in results:
        print(res.row())
    same = sum(r.identical for r in results)
    print(f"identical answers: {same} of {len(results)}")
    return 0 if same == len(results) else 1


def cmd_compare(args: argparse.Namespace) -> int:
    print(compare(args.a, args.b))
    return 0


def cmd_charts(args: argparse.Namespace) -> int:
    meta, steps = load_json(args.json)
    print(format_table(steps))
    for path in write_charts(steps, args.out, args.title or meta.get("command", ""), Criteria()):
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="agent steps against a backend")
    _common(p)
    _workload(p)
    p.add_argument("--agents", type=_ints, default=[10], help="agent counts, one step each: 50,100,200")
    p.add_argument("--duration", type=float, default=600.0, help="seconds per step")
    p.add_argument("--warmup", type=float, default=120.0, help="seconds excluded from the statistics")
    p.add_argument("--ramp", type=float, default=30.0, help="agents start spread over this many seconds")
    p.add_argument("--drain", type=float, default=120.0, help="time for in-flight requests after a step")
    p.add_argument("--pause", type=float, default=5.0, help="seconds between steps")
    p.add_argument("--out", default=None, help="JSON result path")
    p.add_argument("--charts", default=None, help="directory for summary.png and timeline.png")
    add_quick(p, argv, url=None, agents=[2], context=8_000, pacing=0.2, duration=4.0, warmup=1.0, ramp=1.0,
              drain=10.0, pause=0.0)
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("cold-start", help="N fresh conversations of one size at once")
    _common(p)
    _workload(p)
    p.add_argument("--conversations", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=16)
    p.set_defaults(fn=cmd_cold_start)
    p = sub.add_parser("cache-check", help="same long prompt cold then cached, greedy; answers compared")
    _common(p)
    p.add_argument("--sizes", type=_ints, default=[16_000, 32_000, 64_000, 128_000, 200_000])
    p.add_argument("--depth", type=float, default=0.5, help="where the fact sits (0 start .. 1 end)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.set_defaults(fn=cmd_cache_check)
    p = sub.add_parser("compare", help="compare two result JSONs")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("charts", help="table and charts from a result JSON")
    p.add_argument("json")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default=None)
    p.set_defaults(fn=cmd_charts)
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except TraceError as exc:
        print(f"error: bad trace file: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
