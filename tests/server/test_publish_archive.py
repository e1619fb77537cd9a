"""What the published archive holds: every module the worker imports, and no test stand-in.

The archive is built as ``python publish.py --dry-run`` builds it (``publish.build_package``, the
SDK's ``package_backend``). "What the worker needs" is computed, not listed: the closure of our
own imports (function-level ones included) from the two entry points a worker runs, the SDK's
``deepinfer_backend:DeepInferBackend`` and the rank processes' ``python -m rank.worker``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import publish

REPO = Path(publish.__file__).resolve().parent
ENTRY_MODULES = ("deepinfer_backend", "rank.worker")
STANDIN_PACKAGE = "standins"
OUR_TOP_LEVEL = (*publish.CODE_PACKAGES, "deepinfer_backend", STANDIN_PACKAGE)


def _module_path(module: str, root: Path) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for each of our modules ``path`` imports, anywhere."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top_level = {id(node) for node in tree.body}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # ``from pkg import mod`` imports a submodule when one exists
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            if name.split(".")[0] in OUR_TOP_LEVEL:
                found.append((name, id(node) in top_level))
    return found


def _closure(root: Path) -> tuple[set[str], list[str]]:
    """Our modules reachable from the entry points, and every import of the stand-ins met."""
    seen: set[str] = set()
    standin_imports: list[str] = []
    todo = list(ENTRY_MODULES)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        path = _module_path(module, root)
        if path is None:
            continue  # ``from pkg import name`` where name is not a module
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages run first
        for name, module_level in _imports(path, module):
            if name.split(".")[0] == STANDIN_PACKAGE:
                if _module_path(name, root) is not None:
                    level = " at module level" if module_level else ""
                    standin_imports.append(f"{module} imports {name}{level}")
            else:
                todo.append(name)
    return seen, standin_imports


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("dist")
    pkg, names = publish.build_package("0.0.0+test", publish.DEFAULT_NAME, str(out), "3.12")
    return Path(pkg.path), names


def test_archive_lists_no_standin_and_every_module_the_worker_imports(
        archive: tuple[Path, list[str]]) -> None:
    _, names = archive
    # the archive's file list (shown with -s or -rP): product packages, the entry module, metadata
    print(f"\narchive: {len(names)} files; top level: {sorted({n.split('/')[0] for n in names})}")
    print("\n".join(sorted(names)))
    assert (REPO / STANDIN_PACKAGE / "scripted_engine.py").is_file()  # the checkout has them ...
    assert not [n for n in names if n.split("/")[0] in publish.NON_PRODUCT_PACKAGES]  # ... the archive not
    assert not [n for n in names if "fake_deepinfer" in n or "scripted_" in n]

    modules, standin_imports = _closure(REPO)
    assert {"deepinfer_backend", "rank.worker", "rank.engines", "rank.deepinfer_adapter",
            "rank.reference_engine", "server.app", "cache.manager", "protocol.render"} <= modules
    needed = {_module_path(m, REPO).relative_to(REPO).as_posix() for m in modules}  # type: ignore[union-attr]
    assert sorted(needed - set(names)) == []
    assert {"requirements.txt", "manifest.json", publish.BUILD_INFO_NAME} <= set(names)
    # The product reaches the stand-ins only lazily, behind the scripted engine's own check.
    assert standin_imports == ["rank.engines imports standins.scripted_engine"]


def test_unpacked_archive_refuses_engine_scripted_clearly(archive: tuple[Path, list[str]],
                                                          tmp_path: Path) -> None:
    path, _ = archive
    with tarfile.open(path) as tar:
        tar.extractall(tmp_path, filter="data")
    code = (
        "import deepinfer_backend, rank.worker, rank.engines\n"
        "from server.config import WorkloadConfig\n"
        "assert not rank.engines.scripted_engine_available()\n"
        "try:\n"
        "    WorkloadConfig(engine='scripted', script_file='replies.json')\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('engine scripted accepted')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "engine 'scripted' is a test stand-in" in res.stdout
    assert "development checkout only" in res.stdout
