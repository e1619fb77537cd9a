"""The vote filler on DeepInfer's compiled Scheduler: time to first token with it off and on, in one run.

    bash scripts/build_deepinfer.sh                 # once per machine (cached)
    .venv/bin/python -m bench.vote_filler_bench     # 4 ranks, 8 agents per rank, 60 s per setting
    .venv/bin/python -m bench.vote_filler_bench --quick   # stand-in core, 2 ranks x 2 agents, 1.5 s each

What runs: a ``RankGroup`` of real ``rank.worker`` processes on the DeepInfer venv, each with
the DeepInfer adapter over DeepInfer's compiled ``Scheduler``, ``BlockManager``, ``Sequence`` and
output pools (``standins.fake_deepinfer_lockstep``, ``core: installed``) and a null forward; the
step type is DeepInfer's own ALL/ANY vote across the ranks at its default intervals (70 / 100),
and the filler (``rank/vote_filler.py``) is the product's. No server and no cache: closed-loop
agents, pinned to a rank each, send cold prompts whose sizes follow the tool-result shape of
``bench/loadgen/distributions.py`` (lognormal, p50 / p90 scaled to the step budget, as 300 /
3,000 tokens are to DeepInfer's 16,384), read the reply and pause. The group is started twice,
filler off then on, with the same seed.

What it shows: the wait for a prompt step that the simulator models (``docs/loadtest.md``, "The
vote filler"), on DeepInfer's real vote, in this machine's wall time. With a null forward a
prompt step costs what a decode step does, so the decode-speed cost the simulator predicts (the
prefill's GPU time) does not appear here. ``--core stand-in`` runs DeepInfer's Python stand-in
core on this interpreter instead (no build needed; the same vote, not DeepInfer's compiled code).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.decode_bench import build_dir
from bench.support.quick import add_quick
from rank.config import RankConfig
from rank.engine import EngineRequest, SamplingParams
from rank.group import RankGroup


def config(args: argparse.Namespace, vote_filler: bool, build: Path | None) -> RankConfig:
    """``build`` None: the stand-in core on this interpreter."""
    fake: dict[str, object] = {"num_gpu_blocks": 4096, "vocab_size": 1000, "null_forward": True}
    if build is not None:
        fake["core"] = "installed"
    venv = str(build / "venv") if build is not None else sys.prefix
    return RankConfig(
        engine="deepinfer", deepinfer_venv=venv, model_dir="/nonexistent/model", ep=args.ranks,
        max_model_len=32768, max_num_seqs=64, max_num_batched_tokens=args.budget, l1_cache=False,
        vote_filler=vote_filler, load_timeout_seconds=300,
        deepinfer_env={"DIB_DEEPINFER_MODULE": "standins.fake_deepinfer_lockstep",
                       "DIB_FAKE_DEEPINFER": json.dumps(fake), "OMP_NUM_THREADS": "1"},
    )


async def agent(group: RankGroup, rank: int, index: int, args: argparse.Namespace, stop_at: float,
                ttfts: list[float], tokens: list[int]) -> None:
    rng = np.random.default_rng(args.seed * 10_007 + rank * 101 + index)
    scale = args.budget / 16_384
    sigma = np.log(10) / 1.2816  # p90 / p50 = 10, as 3,000 / 300
    loop = asyncio.get_running_loop()
    n = 0
    while loop.time() < stop_at:
        size = int(np.clip(300 * scale * rng.lognormal(0, sigma), 8, args.budget * 4))
        ids = rng.integers(3, 1000, size=size, dtype=np.int32)
        request = EngineRequest(f"r{rank}-a{index}-{n}", ids,
                                SamplingParams(max_tokens=args.reply_tokens, ignore_eos=True), [], 0, False)
        n += 1
        t0 = loop.time()
        first = True
        async for out in group.submit(rank, request):
            if out.token_ids and first:
                ttfts.append(loop.time() - t0)
                first = False
            tokens.append(len(out.token_ids))
        await asyncio.sleep(args.pause)


async def phase(args: argparse.Namespace, vote_filler: bool, build: Path | None) -> dict[str, float]:
    if build is None:
        python, env = sys.executable, dict(os.environ)
    else:
        python = str(build / "venv" / "bin" / "python")
        env = {**os.environ, "LD_LIBRARY_PATH": str(build / "stubs")}  # the driver's libcuda.so.1 is there
    group = RankGroup(config(args, vote_filler, build), python=python, base_env=env)
    await group.start()
    try:
        loop = asyncio.get_running_loop()
        warm_ttfts: list[float] = []
        warm_tokens: list[int] = []
        ttfts: list[float] = []
        tokens: list[int] = []
        start = loop.time()
        warm = asyncio.gather(*(agent(group, r, i, args, start + args.warmup, warm_ttfts, warm_tokens)
                                for r in range(args.ranks) for i in range(args.agents)))
        await warm
        t0 = loop.time()
        await asyncio.gather(*(agent(group, r, i, args, t0 + args.duration, ttfts, tokens)
                               for r in range(args.ranks) for i in range(args.agents)))
        elapsed = loop.time() - t0
        fillers = sum(group.stats(r).num_vote_fillers_total for r in range(args.ranks))
    finally:
        await group.close()
    t = np.asarray(ttfts)
    return {"turns": float(t.size), "ttft_p50_s": float(np.percentile(t, 50)),
            "ttft_p95_s": float(np.percentile(t, 95)), "ttft_p99_s": float(np.percentile(t, 99)),
            "output_tokens_per_s": sum(tokens) / elapsed, "fillers": float(fillers)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vote_filler_bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--agents", type=int, default=8, help="closed-loop agents per rank")
    parser.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens per rank")
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--pause", type=float, default=0.1, help="seconds between an agent's turns")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds per setting")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--build-dir", default=None,
                        help="scripts/build_deepinfer.sh's directory (default: the one it prints here)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--core", choices=("installed", "stand-in"), default="installed",
                        help="DeepInfer's compiled scheduler (installed) or the Python stand-in's")
    add_quick(parser, argv, core="stand-in", ranks=2, agents=2, duration=1.5, warmup=0.5, reply_tokens=16)
    args = parser.parse_args(argv)
    build = build_dir(args.build_dir) if args.core == "installed" else None
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; core {args.core}; {args.ranks} "
          f"ranks x {args.agents} agents, budget {args.budget}, replies {args.reply_tokens} tokens, "
          f"pause {args.pause} s, {args.duration:.0f} s per setting", flush=True)
    results = {}
    for on in (False, True):
        t0 = time.monotonic()
        results["on" if on else "off"] = r = asyncio.run(phase(args, on, build))
        print(f"  filler {'on ' if on else 'off'}: {r['turns']:.0f} turns, TTFT p50 / p95 / p99 "
              f"{r['ttft_p50_s']:.3f} / {r['ttft_p95_s']:.3f} / {r['ttft_p99_s']:.3f} s, "
              f"{r['output_tokens_per_s']:.0f} output tokens/s, {r['fillers']:.0f} fillers "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
