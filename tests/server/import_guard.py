"""An import guard: code that can import only named distributions (and the standard library and
this project's packages), as in a worker venv that holds nothing else.

``allowed_modules(requirements)`` turns requirement lines into the top-level module names their
distributions and all their dependencies provide (read from this venv's installed metadata).
``guard_source(allowed, what)`` is Python source that installs the guard (every other top-level
import raises ``ImportError`` naming the module); ``guard.release()`` lifts it (the point where
the worker puts the DeepInfer venv on ``sys.path``). ``run_guarded`` runs code under it in a fresh
interpreter; ``guarded_python`` writes an executable that runs ``python -m MODULE`` under it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
OUR_PACKAGES = ("deepinfer_backend", "server", "protocol", "cache", "rank", "standins", "bench")


def requirement_lines(path: Path) -> list[str]:
    """The requirement specifiers of a requirements file (comments, blank lines, options dropped)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str]) -> set[str]:
    """Distribution names (normalised) of the requirements and everything they depend on."""
    seen: set[str] = set()
    todo = [(Requirement(line), frozenset[str]()) for line in requirements]
    while todo:
        req, extras = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
            continue
        key = f"{_normalise(req.name)}[{','.join(sorted(req.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # not installed here (e.g. a platform-specific dependency): provides nothing
        todo += [(Requirement(r), frozenset(req.extras)) for r in (dist.requires or [])]
    return {key.split("[")[0] for key in seen}


def allowed_modules(requirements: list[str]) -> set[str]:
    """Top-level module names provided by the requirements' distribution closure."""
    dists = _closure(requirements)
    return {module for module, providers in metadata.packages_distributions().items()
            if any(_normalise(p) in dists for p in providers)}


def guard_source(allowed: set[str], what: str) -> str:
    """Source that installs ``guard`` (a meta path finder) as the first finder."""
    return f"""
import importlib.abc, importlib.machinery, os, sys, sysconfig
_ALLOWED = {sorted(allowed | set(OUR_PACKAGES))!r}
_ALLOWED = set(_ALLOWED) | set(sys.stdlib_module_names)
_STDLIB = sysconfig.get_path("stdlib")
_STDLIB_DIRS = [_STDLIB, sysconfig.get_path("platstdlib"), os.path.join(_STDLIB, "lib-dynload")]
class _Guard(importlib.abc.MetaPathFinder):
    active = True
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if not self.active or top in _ALLOWED or importlib.machinery.PathFinder.find_spec(top, _STDLIB_DIRS):
            return None  # allowed, or part of the standard library (e.g. _sysconfigdata_*)
        raise ModuleNotFoundError(f"import of {{name!r}} blocked: not provided by {what}", name=name)
    def release(self):
        self.active = False
guard = _Guard()
sys.meta_path.insert(0, guard)
"""


def run_guarded(code: str, allowed: set[str], what: str,
                timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (which sees ``guard``) in a fresh interpreter of this venv under the guard."""
    return subprocess.run(
        [sys.executable, "-c", guard_source(allowed, what) + code], cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(Path.home())},
        capture_output=True, text=True, timeout=timeout_s,
    )


def guarded_python(directory: Path, allowed: set[str], what: str) -> Path:
    """An executable ``python`` that runs ``-m MODULE ARGS`` under the guard (for rank processes)."""
    main = directory / "guarded_main.py"
    main.write_text(guard_source(allowed, what) + (
        "import runpy\n"
        "assert sys.argv[1] == '-m', sys.argv\n"
        "module = sys.argv[2]\n"
        "sys.argv = [module] + sys.argv[3:]\n"
        "runpy.run_module(module, run_name='__main__', alter_sys=True)\n"), encoding="utf-8")
    exe = directory / "python"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {main} "$@"\n', encoding="utf-8")
    exe.chmod(0o755)
    return exe
