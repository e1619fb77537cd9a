"""Bench entry points at their quick sizes complete and print their figures (a benchmark nothing
runs breaks silently); ``bench`` never imports ``tests``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

QUICK = [
    (["bench.protocol_bench", "--quick"], "parsed request -> prompt ids"),
    (["bench.cache_bench", "--tokens", "20000", "--repeats", "1", "--skip-replay"],
     "warm turn: admit + finish"),
    (["bench.l1_restore_gpu", "--device", "cpu", "--tokens", "4096", "--repeats", "1", "--spare-blocks", "8"],
     "import / contiguous copy ="),
]


@pytest.mark.parametrize(("argv", "figure"), QUICK, ids=[a[0] for a, _ in QUICK])
def test_quick_mode_completes_and_prints_its_figures(argv: list[str], figure: str) -> None:
    """Red before for l1_restore_gpu: EngineMisuse (the engine's transfers had no host pool)."""
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert figure in proc.stdout, proc.stdout[-3000:]


def test_bench_never_imports_tests() -> None:
    offenders = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n == "tests" or n.startswith("tests.")]
    assert not offenders
