"""One load step of the agent load generator, with every request's raw record (absolute times).

    python -m bench.multi_gpu.load --url http://127.0.0.1:8000 --context 32000 --agents 16 \
        --duration 240 --warmup 45 --out records.json
    python -m bench.multi_gpu.load --quick     # 2 agents, 8K, 4 s against bench.loadgen.fake_server, no file

This is ``bench.loadgen``'s own step (``runner.run_step``: the same agents, request shapes and
measures as ``python -m bench.loadgen run``); it runs in its own process so that the client's
parsing does not share a GIL with the server, and it writes each ``RequestRecord`` with its
``time.monotonic()`` stamps (system-wide on Linux), so the driver can cut the records at the
moments it injected a fault or moved a session.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import orjson

from bench.loadgen import fake_server
from bench.loadgen.client import RequestRecord
from bench.loadgen.distributions import WorkloadParams, make_turn_source
from bench.loadgen.runner import RunConfig, run_step
from bench.loadgen.textgen import TextSynth
from bench.support.quick import add_quick

RECORD_FIELDS = ("agent_id", "session_id", "t_start", "t_end", "ttft_s", "decode_s", "output_tokens",
                 "input_tokens", "cached_tokens", "creation_tokens", "status", "error", "stop_reason",
                 "cold", "context_tokens_sent")


def record_to_dict(r: RequestRecord) -> dict[str, Any]:
    return {name: getattr(r, name) for name in RECORD_FIELDS}


def record_from_dict(d: dict[str, Any]) -> RequestRecord:
    return RequestRecord(**{name: d[name] for name in RECORD_FIELDS if name in d})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--context", type=int, default=32_000)
    p.add_argument("--size-scale", type=float, default=1.0)
    p.add_argument("--pacing", type=float, default=3.0)
    p.add_argument("--pacing-dist", choices=["constant", "lognormal"], default="constant")
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--warmup", type=float, default=30.0)
    p.add_argument("--ramp", type=float, default=10.0)
    p.add_argument("--drain", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit, s")
    p.add_argument("--out", required=True)
    add_quick(p, argv, url=None, context=8_000, pacing=0.2, agents=2, duration=4.0, warmup=1.0, ramp=1.0,
              drain=10.0, out=None)
    args = p.parse_args(argv)
    if args.url is None:
        with fake_server.running() as url:
            args.url = url
            return run(args)
    return run(args)


def run(args: argparse.Namespace) -> int:
    params = WorkloadParams(context_target_tokens=args.context, pacing=args.pacing_dist, pacing_s=args.pacing,
                            size_scale=args.size_scale)
    config = RunConfig(base_url=args.url, seed=args.seed, duration_s=args.duration, warmup_s=args.warmup,
                       ramp_s=args.ramp, drain_s=args.drain, request_timeout_s=args.timeout)
    label = f"{args.context // 1000}K x {args.agents}"
    started = time.monotonic()
    records, t_from, t_to = asyncio.run(
        run_step(params, make_turn_source(params, None), TextSynth(), config, args.agents, label))
    doc = {"t_launch": started, "t_measure_from": t_from, "t_measure_to": t_to, "agents": args.agents,
           "context": args.context, "params": params.model_dump(), "argv": sys.argv,
           "records": [record_to_dict(r) for r in records]}
    if args.out:
        with open(args.out, "wb") as f:
            f.write(orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY))
    print(f"load: {len(records)} requests, {sum(r.error is not None for r in records)} errors", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
