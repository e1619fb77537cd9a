"""Hot-path regression guard: this tree against a recorded baseline commit, interleaved, one run.

Run: ``bash scripts/perf_guard.sh`` (checks out the baseline named in ``bench/perf_baseline.txt``
as a git worktree, then runs this module), or directly
``python -m bench.perf_guard --baseline-dir DIR [--rounds 3] [--ratio 1.25]``. ``--quick`` checks the
guard itself in seconds: this tree against itself, one round of the cache probe (no torch, no server),
no ratio that can fail (every probe runs and its figures are found in what it prints).

Each probe is a bench entry point at its quick size, run as a subprocess from each tree's root
(so each side runs its own product and bench code); its printed figures are read back with a
regex. Rounds alternate which side goes first; the guard compares the median of each figure over
the rounds and fails (exit 1) when this tree's median is more than ``--ratio`` times the
baseline's. Figures are CPU time where the bench offers it (a shared 2-core CI machine makes
wall time noisy). A probe whose module the baseline does not have is skipped with that reason.

Moving the baseline forward is deliberate: a commit that edits ``bench/perf_baseline.txt``, with
the reason (the slowdown accepted, or the speedup to hold) in its message.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.support.quick import add_quick

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Probe:
    name: str
    module: str
    args: tuple[str, ...]
    figures: dict[str, str]  # figure name -> regex whose group 1 is the number (lower is better)


PROBES = (
    Probe("request -> ids", "bench.protocol_bench", ("--quick",), {
        "parsed->ids ms": r"parsed request -> prompt ids[^:]*: ([\d.]+) ms",
        "body->ids ms": r"body bytes to ids ([\d.]+) ms",
    }),
    Probe("cache admit/finish", "bench.cache_bench",
          ("--tokens", "200000", "--repeats", "7", "--skip-replay"), {
        "cold finish ms": r"cold: finish[^\n]*?([\d.]+) ms",
        "warm admit+finish ms": r"warm turn: admit \+ finish, total\s+([\d.]+) ms",
    }),
    Probe("serving CPU per token", "bench.serving_bench",
          ("--service-only", "--concurrency", "64", "--max-tokens", "128"), {
              "service us/token": r"ChatService \+ protocol: ([\d.]+) us CPU",
          }),
    Probe("decode CPU per rank step", "bench.decode_bench",
          ("--core", "stand-in", "--ranks", "2", "--seqs", "4", "--max-tokens", "100", "--py-spy", "off"), {
              # the rank processes' CPU over the run per token (always printed; the per-step split
              # needs steady steps, which a short run on a busy machine may not have)
              "ranks CPU us/token": r"\"ranks_cpu_us_per_token\": ([\d.]+)",
          }),
)


def run_probe(probe: Probe, tree: Path, timeout_s: float) -> dict[str, float]:
    """One run of ``probe`` from ``tree``'s root; its figures (raises on failure)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", probe.module, *probe.args]
    if probe.module == "bench.decode_bench":
        cmd.append("--json")
    proc = subprocess.run(cmd, check=False, cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{probe.module} in {tree} exited {proc.returncode}:\n{proc.stdout[-2000:]}"
                           f"\n{proc.stderr[-2000:]}")
    out: dict[str, float] = {}
    for figure, pattern in probe.figures.items():
        m = re.search(pattern, proc.stdout)
        if m is None:
            raise RuntimeError(f"{probe.module} in {tree} did not print {figure!r}:\n{proc.stdout[-2000:]}")
        out[figure] = float(next(g for g in m.groups() if g is not None))
    return out


def measure(probes: list[Probe], trees: dict[str, Path], rounds: int, timeout_s: float,
            samples: dict[tuple[str, str, str], list[float]], errors: list[str]) -> None:
    """``rounds`` interleaved runs of each probe on both sides, their figures added to ``samples``."""
    for probe in probes:
        for round_no in range(rounds):
            order = ["baseline", "this tree"] if round_no % 2 == 0 else ["this tree", "baseline"]
            for side in order:
                try:
                    figures = run_probe(probe, trees[side], timeout_s)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    errors.append(f"{probe.name} ({side}): {exc}")
                    continue
                for figure, value in figures.items():
                    samples.setdefault((probe.name, figure, side), []).append(value)


def ratios(probes: list[Probe], samples: dict[tuple[str, str, str], list[float]]
           ) -> list[tuple[Probe, str, float, float, float]]:
    """(probe, figure, baseline median, this tree's median, ratio) for every figure both sides have."""
    rows = []
    for probe in probes:
        for figure in probe.figures:
            b = samples.get((probe.name, figure, "baseline"))
            n = samples.get((probe.name, figure, "this tree"))
            if b and n:
                mb, mn = statistics.median(b), statistics.median(n)
                rows.append((probe, figure, mb, mn, mn / mb if mb > 0 else 1.0))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-dir", required=True, type=Path, help="checkout of the baseline commit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--confirm-rounds", type=int, default=4,
                    help="extra interleaved rounds for a probe over the ratio; it fails only if the median "
                    "over all its rounds is still over (0: no confirmation)")
    ap.add_argument("--ratio", type=float, default=1.25)
    ap.add_argument("--probe", action="append", default=None, help="run only probes whose name has this")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per probe run")
    add_quick(ap, argv, baseline_dir=ROOT, rounds=1, confirm_rounds=0, ratio=1e9,
              probe=["cache"])
    args = ap.parse_args(argv)
    base = args.baseline_dir.resolve()
    trees = {"baseline": base, "this tree": ROOT}
    probes = [p for p in PROBES if not args.probe or any(s in p.name for s in args.probe)]
    samples: dict[tuple[str, str, str], list[float]] = {}
    skipped: list[str] = []
    errors: list[str] = []
    started = time.monotonic()
    for probe in list(probes):
        if not (base / (probe.module.replace(".", "/") + ".py")).exists():
            skipped.append(f"{probe.name}: the baseline has no {probe.module}")
            probes.remove(probe)
    measure(probes, trees, args.rounds, args.timeout, samples, errors)
    # A shared machine's noise can put one short run over the line: a probe over the ratio runs
    # more rounds, and is judged on the median of all of them.
    suspects = list({id(p): p for p, _, _, _, r in ratios(probes, samples) if r > args.ratio}.values())
    if suspects and args.confirm_rounds:
        print(f"perf guard: over {args.ratio:.2f}x after {args.rounds} rounds: "
              f"{', '.join(p.name for p in suspects)}; {args.confirm_rounds} more rounds to confirm",
              flush=True)
        measure(suspects, trees, args.confirm_rounds, args.timeout, samples, errors)
    failed = bool(errors)
    print(f"perf guard: this tree vs baseline {base}, {args.rounds} interleaved rounds "
          f"(+{args.confirm_rounds} where over), fail above {args.ratio:.2f}x the baseline's median "
          f"({time.monotonic() - started:.0f} s)")
    print(f"  {'probe':<26}{'figure':<24}{'baseline':>10}{'this tree':>11}{'ratio':>8}")
    for probe, figure, mb, mn, ratio in ratios(probes, samples):
        bad = ratio > args.ratio
        failed |= bad
        flag = "  FAIL" if bad else ""
        print(f"  {probe.name:<26}{figure:<24}{mb:>10.2f}{mn:>11.2f}{ratio:>7.2f}x{flag}")
    for line in skipped:
        print(f"  skipped: {line}")
    for line in errors:
        print(f"  ERROR: {line}")
    print("perf guard: FAIL" if failed else "perf guard: pass")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
