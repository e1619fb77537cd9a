"""Request -> ids of several checkouts, interleaved in one run (not a test).

Run: ``python -m bench.protocol_ab DIR [DIR ...] [--rounds 3] [--repeats 9] [--tokens 500000]``
(``--quick``: this checkout alone, a 40K-token session, one round of one repeat), each DIR a checkout
(``git worktree add --detach DIR <commit>``, its ``.venv`` a link to this
one's). Each round runs every checkout's own ``bench.protocol_bench.bench_prepare`` once in a
subprocess from its root (its product and bench code), in an order that rotates by round; prints
per checkout the median over rounds of the per-round medians (CPU ms, ``time.process_time``) of
parsed request -> ids and body bytes -> ids, with their range, and the load average. Unlike
``bench.perf_guard`` it compares any number of trees at full size (a 474K-token session) and
skips the whole-prompt and streaming parts of the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.support.quick import add_quick

_CHILD = """
import json, sys
import bench.protocol_bench as B
from protocol.api import Protocol
from protocol.ledger import OutputLedger
from protocol.tokenize import PromptTokenizer
proto = Protocol(PromptTokenizer.load(), OutputLedger(), [B.MODEL], 1_064_960)
body, _ = B.build_session(int(sys.argv[1]))
r = B.bench_prepare(proto, body, int(sys.argv[2]))
print(json.dumps({"parsed": r["parsed_to_ids_ms"], "body": r["bytes_to_ids_ms"] + r["validate_ms"]}))
"""


def run_one(tree: Path, tokens: int, repeats: int) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tokens), str(repeats)], cwd=tree, check=False,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: exited {proc.returncode}\n{proc.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return figures


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="*", type=Path, help="checkouts (default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=500_000)
    add_quick(ap, argv, tokens=40_000, rounds=1, repeats=1)
    args = ap.parse_args(argv)
    args.trees = args.trees or [Path(".")]
    samples: dict[Path, dict[str, list[float]]] = {t: {"parsed": [], "body": []} for t in args.trees}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = args.trees[r % len(args.trees):] + args.trees[: r % len(args.trees)]
        for tree in order:
            for name, value in run_one(tree, args.tokens, args.repeats).items():
                samples[tree][name].append(value)
            load.append(os.getloadavg()[0])
    print(f"{args.rounds} rounds x {args.repeats} repeats, {args.tokens:,}-token session; "
          f"load average (1 min) {min(load):.1f}-{max(load):.1f}")
    print(f"  {'tree':<40}{'parsed -> ids ms':>24}{'body -> ids ms':>24}")
    for tree, figs in samples.items():
        cells = [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for v in figs.values()]
        print(f"  {tree!s:<40}{cells[0]:>24}{cells[1]:>24}")


if __name__ == "__main__":
    main()
