"""Four parallel branches under one session id vs four separate sessions, on 4 CPU reference
ranks (real rank processes, lockstep): wall time, per-rank turns and the peak in flight per rank.

Shapes (each round uses fresh prompts, ``--prompt-tokens`` each, so no round reuses another's
cache):

* ``agent-ids``: one ``X-Claude-Code-Session-Id``, each request with its own
  ``x-claude-code-agent-id`` (Claude Code's subagents);
* ``detected``: one session id, no agent headers (older CLIs, other clients);
* ``separate``: four session ids (the reference);
* ``stacked``: one session id with ``branch_routing: false`` (every turn on the home rank).

Run: ``.venv/bin/python -m bench.branch_spread`` (``--rounds``, ``--prompt-tokens``,
``--model``, ``--ranks``, ``--device``, ``--num-blocks``, ``--l1-gb``; ``--quick``: 1 rank, the
null model, 1 round of ~200 tokens, seconds). With ``--device cuda`` on a host with a GPU per
rank, each rank owns its GPU, the case where stacking four branches on one rank costs.
The shapes served by one server run interleaved, round by round; ``stacked`` needs a server of
its own, where ``separate-off`` (four session ids again) is its reference. It prints one line per
shape:
the median wall time of a round, its ratio to ``separate``, the
turns routed to each rank (``deepinfer_cache_routed_turns_total``) and the peak number of
requests running on one rank (``deepinfer_rank_num_running``, polled every 10 ms), and what the
rounds made the cache do (tokens served from cache, prefix copies, L1 writes and restores).
Figures are in ``docs/cache.md`` ("Routing rules"). On a machine whose cores are fewer than the
ranks, the ranks share cores and the spread gains less than it would with one GPU per rank.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.loop_stall_bench import start_server, stop_server
from bench.support.quick import add_quick

WORDS = ["alpha", "beta", "gamma", "delta", "kernel", "buffer", "queue", "socket", "thread", "module",
         "vector", "matrix", "render", "parse", "token", "cache", "block", "rank", "step", "batch"]


def prompt_text(rng: random.Random, num_tokens: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randint(0, 99)) for _ in range(num_tokens // 2))


async def _poll_running(url: str, stop: asyncio.Event, peak: list[int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            text = (await client.get("/metrics")).text
            for m in re.finditer(r'^deepinfer_rank_num_running\{rank="(\d+)"\} (\S+)', text, re.MULTILINE):
                rank, value = int(m.group(1)), int(float(m.group(2)))
                peak[rank] = max(peak[rank], value)
            await asyncio.sleep(0.01)


# what else a round made the cache do, summed over labels: a difference between shapes that place
# alike shows here (a prefix copied through L1, a write-through, a restore)
COUNTERS = {"cached": "deepinfer_cache_cached_tokens_total", "copies": "deepinfer_cache_prefix_copies_total",
            "written": "deepinfer_cache_l1_written_blocks_total",
            "restored": "deepinfer_cache_l1_restored_tokens_total"}


def _counters(text: str) -> dict[str, int]:
    out = {}
    for key, name in COUNTERS.items():
        out[key] = int(sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)", text,
                                                                   re.MULTILINE)))
    return out


def _routed(text: str, ranks: int) -> list[int]:
    per_rank = [0] * ranks
    pattern = r'^deepinfer_cache_routed_turns_total\{[^}]*rank="(\d+)"[^}]*\} (\S+)'
    for m in re.finditer(pattern, text, re.MULTILINE):
        per_rank[int(m.group(1))] += int(float(m.group(2)))
    return per_rank


async def _round(url: str, shape: str, rng: random.Random, prompt_tokens: int, tag: str,
                 max_tokens: int, ranks: int) -> tuple[float, list[int]]:
    peak = [0] * ranks
    stop = asyncio.Event()
    poller = asyncio.create_task(_poll_running(url, stop, peak))
    prompts = [prompt_text(rng, prompt_tokens) for _ in range(4)]

    async def one(i: int, client: httpx.AsyncClient) -> None:
        headers = {"x-api-key": "bench", "anthropic-version": "2023-06-01"}
        if shape.startswith("separate"):
            headers["x-claude-code-session-id"] = f"{tag}-s{i}"
        else:
            headers["x-claude-code-session-id"] = tag
        if shape == "agent-ids":
            headers["x-claude-code-agent-id"] = f"agent:{tag}-{i}"
            headers["x-claude-code-agent-type"] = "Explore"
        body = {"model": "default", "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": prompts[i]}]}
        r = await client.post("/v1/messages", json=body, headers=headers)
        r.raise_for_status()

    await asyncio.sleep(0.05)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, client) for i in range(4)))
        wall = time.perf_counter() - t0
    stop.set()
    await poller
    return wall, peak


async def _shapes(url: str, shapes: tuple[str, ...], rounds: int, prompt_tokens: int, max_tokens: int,
                  seed: int, ranks: int) -> list[dict[str, object]]:
    """``rounds`` rounds of every shape, interleaved (round n runs the shapes in an order rotated
    by n), so a change in the machine's other load falls on every shape alike."""
    rng = random.Random(seed)
    walls: dict[str, list[float]] = {shape: [] for shape in shapes}
    routed = {shape: [0] * ranks for shape in shapes}
    counts = {shape: dict.fromkeys(COUNTERS, 0) for shape in shapes}
    crowded = dict.fromkeys(shapes, 0)  # the most of a round's four turns routed to one rank
    peaks = {shape: [0] * ranks for shape in shapes}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for n in range(rounds):
            for k in range(len(shapes)):
                shape = shapes[(n + k) % len(shapes)]
                text = (await client.get("/metrics")).text
                before, c_before = _routed(text, ranks), _counters(text)
                wall, peak = await _round(url, shape, rng, prompt_tokens, f"{shape}-{seed}-{n}", max_tokens,
                                          ranks)
                text = (await client.get("/metrics")).text
                after, c_after = _routed(text, ranks), _counters(text)
                counts[shape] = {k: v + c_after[k] - c_before[k] for k, v in counts[shape].items()}
                crowded[shape] = max(crowded[shape], *(a - b for a, b in zip(after, before)))
                walls[shape].append(wall)
                routed[shape] = [r + a - b for r, a, b in zip(routed[shape], after, before)]
                peaks[shape] = [max(a, b) for a, b in zip(peaks[shape], peak)]
    return [{"shape": shape, "walls": walls[shape], "median": statistics.median(walls[shape]),
             "routed": routed[shape], "peak": peaks[shape],
             "counts": counts[shape] | {"most on one rank in a round": crowded[shape]}} for shape in shapes]


def _serve(tmp: Path, args: argparse.Namespace, branch_routing: bool) -> tuple[object, str]:
    return start_server(tmp, {"reference_model": args.model, "reference_device": args.device,
                              "ep": args.ranks, "l1_cache": True, "l1_host_gb": args.l1_gb,
                              "reference_num_blocks": args.num_blocks, "max_num_batched_tokens": 8192,
                              "branch_routing": branch_routing, "api_key": "bench"})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--model", default="small")
    ap.add_argument("--ranks", type=int, default=4, help="reference ranks (the 4 branches spread over them)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="the reference ranks' device; cuda: rank r on GPU r (one GPU per rank where "
                         "there are as many as ranks)")
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per rank (128 tokens each)")
    ap.add_argument("--l1-gb", type=float, default=0.25, help="the shared host pool (L1), GB")
    add_quick(ap, argv, rounds=1, prompt_tokens=200, max_tokens=2, model="null", ranks=1)
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="branch-spread-") as tmp_dir:
        servers = ((True, ("separate", "agent-ids", "detected")), (False, ("separate-off", "stacked")))
        for branch_routing, shapes in servers:
            tmp = Path(tmp_dir) / f"routing-{branch_routing}"
            tmp.mkdir()
            proc, url = _serve(tmp, args, branch_routing)
            try:
                # one warm-up round (first-call costs in the rank processes), not counted
                asyncio.run(_shapes(url, ("separate",), 1, args.prompt_tokens, args.max_tokens, seed=999,
                                    ranks=args.ranks))
                results += asyncio.run(_shapes(url, shapes, args.rounds, args.prompt_tokens, args.max_tokens,
                                               seed=int(branch_routing), ranks=args.ranks))
            finally:
                stop_server(proc)  # type: ignore[arg-type]
    base = {r["shape"]: r["median"] for r in results if str(r["shape"]).startswith("separate")}
    print(f"4 branches x ~{args.prompt_tokens} prompt tokens, model {args.model!r}, {args.ranks} reference "
          f"ranks on {args.device}, {args.rounds} rounds each (median wall; shapes interleaved per server), "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end")
    print(f"{'shape':<12} {'wall s':>7} {'vs separate':>11}  routed per rank   peak running per rank  "
          f"{'walls':<25} cache counters over the rounds")
    for r in results:
        walls = " ".join(f"{w:.2f}" for w in r["walls"])  # type: ignore[attr-defined]
        ref = base["separate-off" if r["shape"] in ("separate-off", "stacked") else "separate"]
        print(f"{r['shape']:<12} {r['median']:>7.2f} {r['median'] / ref:>10.2f}x  "  # type: ignore[operator]
              f"{r['routed']!s:<17} {r['peak']!s:<22} {walls:<25} {r['counts']}")


if __name__ == "__main__":
    main()
