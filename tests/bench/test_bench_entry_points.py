"""Every bench entry point, run as its user runs it (``python -m MODULE --quick``), completes and
prints its figures (a benchmark nothing runs breaks silently); ``bench`` never imports ``tests``.

The table below lists each module under ``bench/`` that has a ``__main__``, and the structure
check fails when one is added without a row (or an exemption with its reason), so the list cannot
rot. Figures are printed, never asserted: a row asserts exit 0 and one figure line (a regular
expression on stdout). GPU-only benches (no CPU path) skip unless ``DIB_TEST_DEVICE=cuda``; with
it, the benches that take ``--device`` run on cuda too. ``bench.l3_bench`` needs Mooncake's
client (``scripts/setup_l3.sh``) and skips without it, except where ``DIB_L3_REQUIRED=1`` makes
that a failure, as in ``tests/l3``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICE = os.environ.get("DIB_TEST_DEVICE", "cpu")


@dataclass(frozen=True)
class Entry:
    module: str
    argv: tuple[str, ...]  # after ``-m MODULE``; ``{tmp}`` is the test's own directory
    figure: str  # a regular expression that must match a line of stdout (re.MULTILINE)
    needs: str = ""  # "cuda": GPU only, no CPU path; "l3": Mooncake's client and master
    device: bool = False  # takes --device (its quick mode runs on the CPU)
    slow: str = ""  # why its quick mode cannot be quick (then marked slow)


ENTRIES = (
    Entry("bench.admit_bench", ("--quick",), r"^loads\(\): .* us CPU"),
    Entry("bench.branch_spread", ("--quick",), r"^stacked +[\d.]+ +[\d.]+x"),
    Entry("bench.cache_bench", ("--quick",), r"input tokens served from cache, steady state: [\d.]+%"),
    Entry("bench.connection_probe", ("--quick",), r"^pipelining: one socket that never reads"),
    Entry("bench.decode_bench", ("--quick", "--work-dir", "{tmp}/decode"), r"^CPU over .* us/token"),
    Entry("bench.fault_injection", ("--quick",), r"^  requests lost: \d+"),
    Entry("bench.fence_wait", ("--quick",), r"^simulator \(--transfers fenced\)", needs="cuda"),
    Entry("bench.ipc_latency", ("--quick",), r"^ +uds +python \| .*\d"),
    Entry("bench.l1_restore_gpu", ("--quick",), r"^import / contiguous copy = [\d.]+", device=True),
    Entry("bench.l2_bench", ("--quick", "--dir", "{tmp}"), r"restore \(load \+ import\) .*prefill / restore"),
    Entry("bench.l3_bench", ("--quick", "--dir", "{tmp}"), r"^restores byte-identical: L3 True, L2 True",
          needs="l3"),
    Entry("bench.loadgen", ("run", "--quick"), r"^steady-state cache hit at 2 agents"),
    Entry("bench.loop_stall_bench", ("--quick",), r"^refusal time: median"),
    Entry("bench.multi_gpu.copy_limit", ("--quick",), r"^cpu: +4 blocks .* ok=True", device=True),
    Entry("bench.multi_gpu.load", ("--quick",), r"^load: [1-9]\d* requests"),
    Entry("bench.multi_gpu_run", ("--quick", "--out", "{tmp}"), r"^## Rank SIGKILL under load",
          slow="its CPU check spans a 50 s agent load with a session move and a rank SIGKILL and restart "
               "(3 min on 2 shared cores); tests/multigpu/test_multigpu_run_script.py asserts its phases"),
    Entry("bench.pin_stall", ("--quick",), r"^chunked, re-pin +[\d.]+ +\d+ ", device=True),
    Entry("bench.perf_guard", ("--quick",), r"^perf guard: pass"),
    Entry("bench.protocol_bench", ("--quick",), r"parsed request -> prompt ids .*: [\d.]+ ms median"),
    Entry("bench.protocol_ab", ("--quick",), r"^  \S+ +[\d.]+ \([\d.]+-[\d.]+\) +[\d.]+ \("),
    Entry("bench.rank_bench", ("--quick",), r"IPC \+ lockstep overhead [\d.]+ ms/step", device=True),
    Entry("bench.reliability.storm", ("--quick",), r"^  balance: OK"),
    Entry("bench.restore_copy_paths", ("--quick",), r"^prio -1 runs4 +contiguous", needs="cuda"),
    Entry("bench.serving_bench", ("--quick",), r"^CPU: backend process .* us/token"),
    Entry("bench.simulator", ("--quick", "step"), r"TTFT parts p50/p95: admission"),
    Entry("bench.soak", ("--quick",), r"^verdict: everything flat"),
    Entry("bench.transfer_overlap", ("--quick",), r"^ +loop: step p50 .* round trip p50", device=True),
    Entry("bench.vote_filler_bench", ("--quick",), r"^  filler on : \d+ turns, TTFT p50"),
    Entry("bench.writethrough_cost", ("--quick",), r"^  write-through: TTFT p50"),
)

# modules with a __main__ that are no benchmark, with the reason they have no row
EXEMPT = {
    "bench.loadgen.fake_server": "a stand-in server that runs until stopped; the quick runs of bench.loadgen "
                                 "and bench.multi_gpu.load start it (fake_server.running()) and drive it",
}


def _require(needs: str) -> None:
    if needs == "cuda" and DEVICE != "cuda":
        pytest.skip("GPU only (no CPU path): runs with DIB_TEST_DEVICE=cuda")
    if needs == "l3":
        from bench.l3_bench import master_binary
        from cache.l3_client import mooncake_available

        missing = mooncake_available() or (None if master_binary() else "no mooncake_master")
        if missing is None:
            return
        why = f"Mooncake Store client not installed ({missing}): bash scripts/setup_l3.sh"
        if os.environ.get("DIB_L3_REQUIRED") == "1":
            pytest.fail(why)
        pytest.skip(why)


@pytest.mark.parametrize("entry", [pytest.param(e, id=e.module, marks=[pytest.mark.slow] if e.slow else [])
                                   for e in ENTRIES])
def test_quick_mode_completes_and_prints_its_figures(entry: Entry, tmp_path: Path) -> None:
    """Red before: multi_gpu_run (every admission raised: its recorder took the service's
    SessionHint for a string), l3_bench while the venv's mooncake_master script named an
    interpreter that was gone, and every module without a quick mode (loadgen and
    multi_gpu.load needed a running backend, vote_filler_bench a DeepInfer build)."""
    _require(entry.needs)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in entry.argv]
    if entry.device and DEVICE == "cuda":
        argv += ["--device", "cuda"]
    # TMPDIR: what a bench leaves in the temp directory (server logs, scratch files) goes with tmp_path
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", entry.module, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=280, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert re.search(entry.figure, proc.stdout, re.MULTILINE), proc.stdout[-3000:]


def _entry_modules() -> set[str]:
    """Every module under bench/ that runs as ``python -m``: a ``__main__.py`` (its package) or a
    module with an ``if __name__ == "__main__"`` block."""
    found = set()
    for path in (ROOT / "bench").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        if path.name == "__main__.py":
            found.add(".".join(rel.parent.parts))
        elif re.search(r"^if __name__ == [\"']__main__[\"']:", path.read_text(), re.MULTILINE):
            found.add(".".join(rel.parts))
    return found


def test_every_entry_point_has_a_row_with_a_quick_mode() -> None:
    modules = _entry_modules()
    rows = [e.module for e in ENTRIES]
    assert len(rows) == len(set(rows))
    assert not modules - set(rows) - set(EXEMPT), "bench entry points without a row in ENTRIES (or EXEMPT)"
    assert not (set(rows) | set(EXEMPT)) - modules, "rows for modules that are no entry point"
    assert all("--quick" in e.argv for e in ENTRIES)
    for module in rows:  # the usage says how to run it quick
        path = ROOT / (module.replace(".", "/") + ".py")
        path = path if path.exists() else ROOT / module.replace(".", "/") / "__main__.py"
        assert "--quick" in (ast.get_docstring(ast.parse(path.read_text())) or ""), f"{module}: docstring"


def test_bench_never_imports_tests() -> None:
    offenders = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n == "tests" or n.startswith("tests.")]
    assert not offenders
