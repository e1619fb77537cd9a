"""Request -> ids of several checkouts, interleaved in one run (not a test).

Run: ``python -m bench.protocol_ab DIR [DIR ...] [--rounds 3] [--repeats 9] [--tokens 500000]``
(``--quick``: this checkout alone, a 40K-token session, one round of one repeat), each DIR a checkout
(``git worktree add --detach DIR <commit>``, its ``.venv`` a link to this
one's). Each round runs, in a subprocess from every checkout's root (its product code and its
``bench.protocol_bench.build_session``), in an order that rotates by round, the same
measurement: turn N of the session with the caches the checkout has warm from turn N-1 only,
``prepare_anthropic`` on the parsed dict (parsed -> ids: every check it makes included) and
orjson's parse before it (body -> ids), and a whole pydantic validation of the body apart, for
reference. Prints per checkout the median over rounds of the per-round medians (CPU ms,
``time.process_time``) with their range, and the load average. Unlike
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
import json, statistics, sys, time
import orjson
import bench.protocol_bench as B
from protocol import anthropic_schema as A
from protocol.api import Protocol
from protocol.ledger import OutputLedger
from protocol.tokenize import PromptTokenizer
proto = Protocol(PromptTokenizer.load(), OutputLedger(), [B.MODEL], 1_064_960)
body, _ = B.build_session(int(sys.argv[1]))
prev = dict(body, messages=body["messages"][:-2])
raw = orjson.dumps(body)
parsed, total, validate = [], [], []
for _ in range(int(sys.argv[2])):
    for cache in ("chunks", "history"):  # what this tree has, warm from turn N-1 only
        if hasattr(proto, cache):
            getattr(proto, cache).clear()
    proto.tokenizer.cache.clear()
    proto.prepare_anthropic(prev, {})
    t0 = time.process_time()
    data = orjson.loads(raw)
    t1 = time.process_time()
    proto.prepare_anthropic(data, {})
    t2 = time.process_time()
    A.MessagesRequest.model_validate(data)
    t3 = time.process_time()
    parsed.append((t2 - t1) * 1e3)
    total.append((t2 - t0) * 1e3)
    validate.append((t3 - t2) * 1e3)
print(json.dumps({"parsed": statistics.median(parsed), "body": statistics.median(total),
                  "validate": statistics.median(validate)}))
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
    samples: dict[Path, dict[str, list[float]]] = {t: {"parsed": [], "body": [], "validate": []}
                                                   for t in args.trees}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = args.trees[r % len(args.trees):] + args.trees[: r % len(args.trees)]
        for tree in order:
            for name, value in run_one(tree, args.tokens, args.repeats).items():
                samples[tree][name].append(value)
            load.append(os.getloadavg()[0])
    print(f"{args.rounds} rounds x {args.repeats} repeats, {args.tokens:,}-token session; "
          f"load average (1 min) {min(load):.1f}-{max(load):.1f}")
    print(f"  {'tree':<40}{'parsed -> ids ms':>24}{'body -> ids ms':>24}{'whole validation ms':>24}")
    for tree, figs in samples.items():
        cells = [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for v in figs.values()]
        print(f"  {tree!s:<40}{cells[0]:>24}{cells[1]:>24}{cells[2]:>24}")


if __name__ == "__main__":
    main()
