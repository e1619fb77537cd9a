"""The code's shape, checked: imports run one way down the layers, and no product module grows
past ``MAX_MODULE_LINES``.

Layers (docs/ARCHITECTURE.md): ``protocol | rank < cache < server < deepinfer_backend.py``.
``protocol`` and ``rank`` sit side by side at the bottom and import nothing of each other except
``protocol/sampling.py``, the one definition of the sampling limits that the boundary enforces
and every engine checks again (standard library only). ``cache`` sees the rank layer through its
seam only (``rank.client``, ``rank.engine``, ``rank.errors``, ``rank.ids``). No product module
imports the stand-ins (``standins``, never in the published archive), the benchmarks or the tests,
except ``rank/engines.py`` building engine ``scripted`` (lazily, behind its availability check:
``STANDIN_IMPORTS``).

Every import statement counts: module level, inside functions (a lazy import is still a
dependency) and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("protocol", "rank", "cache", "server")
OURS = {*PRODUCT, "deepinfer_backend", "standins", "bench", "tests", "deploy", "publish"}
MAX_MODULE_LINES = 500
# Over the limit: none (the stand-ins left the product for standins/; DeepInfer's factory moved
# from rank/deepinfer_adapter.py to rank/engines.py). A module listed here that is back under the
# limit fails.
KNOWN_OVER: set[str] = set()
# The one way into the stand-ins from product code: engine 'scripted' in a development checkout.
STANDIN_IMPORTS = {("rank/engines.py", "standins.scripted_engine.ScriptedEngine")}

# What each layer may import of ours (a package, or one module of it).
ALLOWED: dict[str, tuple[str, ...]] = {
    "protocol": ("protocol",),
    "rank": ("rank", "protocol.sampling"),
    "cache": ("cache", "protocol", "rank.client", "rank.engine", "rank.errors", "rank.ids"),
    "server": ("server", "cache", "rank", "protocol"),
    "deepinfer_backend": ("deepinfer_backend", "server", "cache", "rank", "protocol"),
}


def product_files() -> list[Path]:
    files = [REPO / "deepinfer_backend.py"]
    for package in PRODUCT:
        files += sorted((REPO / package).rglob("*.py"))
    return files


def layer_of(path: Path) -> str:
    rel = path.relative_to(REPO)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every module an import statement anywhere in the file names."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = ".".join(path.relative_to(REPO).with_suffix("").parts[: -node.level])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            # ``from pkg import mod`` may name a module: count pkg.mod for each name
            out += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return out


def allowed(importer_layer: str, name: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in ALLOWED[importer_layer])


def violations(paths: list[Path]) -> list[str]:
    bad = []
    for path in paths:
        layer = layer_of(path)
        for line, name in imported_modules(path):
            if (str(path.relative_to(REPO)), name) in STANDIN_IMPORTS:
                continue
            if name.split(".")[0] in OURS and not allowed(layer, name):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {name} ({layer} may import "
                           f"{', '.join(ALLOWED[layer])})")
    return bad


def test_imports_go_one_way_down_the_layers() -> None:
    bad = violations(product_files())
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_the_check_sees_function_level_and_type_checking_imports() -> None:
    """A lazy import inside a function and one under TYPE_CHECKING are both caught."""
    fake = REPO / "rank" / "_layering_probe.py"
    assert not fake.exists()
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from cache.l0_index import Node\n"
        "def f():\n    from server import config\n    import standins.fake_deepinfer\n"
        "from protocol import sampling\n"
    )
    fake.write_text(source, encoding="utf-8")
    try:
        bad = violations([fake])
    finally:
        fake.unlink()
    assert [b.split(" imports ")[1].split(" ")[0] for b in bad] == [
        "cache.l0_index.Node", "server.config", "standins.fake_deepinfer"]


def test_no_product_module_over_the_size_limit() -> None:
    sizes = {str(p.relative_to(REPO)): len(p.read_text(encoding="utf-8").splitlines())
             for p in product_files()}
    over = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert set(over) <= KNOWN_OVER, f"modules over {MAX_MODULE_LINES} lines: {over}"
    assert set(over) == KNOWN_OVER, f"back under the limit, drop from KNOWN_OVER: {KNOWN_OVER - set(over)}"


def test_an_install_holds_only_the_product() -> None:
    """``pip install .`` (editable or not) installs the product packages and
    ``deepinfer_backend.py``; tests/, standins/ and bench/ run from a checkout only."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from setuptools import find_packages

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = find_packages(str(REPO), include=config["packages"]["find"]["include"])
    assert {name.split(".")[0] for name in found} == set(PRODUCT), found
    assert config["py-modules"] == ["deepinfer_backend"]


# Code and docs speak to a reader of the repository: no "issue N" / "session N" (the tracker
# and the team's work sessions mean nothing in a clone) and no path to material beside the
# checkout (it does not exist in a clone); facts from outside cite their public source.
UNREADABLE = re.compile(r"\b[Ii]ssues? #?\d+\b|\b[Ss]ession \d+\b(?![.,%]\d)"
                        r"|shared/reference|/work/shared|\breference/[a-z0-9-]+\.md")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt"}
NOT_OURS = {".venv", ".git", "node_modules", "results", "captures", "__pycache__", ".mypy_cache",
            ".pytest_cache", ".hypothesis"}


def unreadable_references(paths: list[Path]) -> list[str]:
    bad = []
    for path in paths:
        for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if UNREADABLE.search(line):
                bad.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()[:120]}")
    return bad


def repository_text_files() -> list[Path]:
    return [p for p in sorted(REPO.rglob("*"))
            if p.suffix in TEXT_SUFFIXES and p.is_file() and p != Path(__file__).resolve()
            and not NOT_OURS.intersection(p.relative_to(REPO).parts)]


def test_code_and_docs_cite_what_a_clone_can_read() -> None:
    bad = unreadable_references(repository_text_files())
    assert not bad, "\n".join(bad[:20])


def test_the_reference_check_sees_a_planted_one(tmp_path: Path) -> None:
    planted = REPO / "docs" / "_planted_reference_check.md"
    planted.write_text("Fixed in issue 31 (session 10); see ../shared/reference/measurements.md.\n"
                       "A session 99.1% cached, 1,610 sessions: fine.\n", encoding="utf-8")
    try:
        bad = unreadable_references([planted])
    finally:
        planted.unlink()
    assert len(bad) == 1 and bad[0].endswith("measurements.md."), bad


# Docs are reference (how a thing works, how to run and read its benchmarks, one current results
# table); history lives in git and CHANGELOG.md. A doc past this many lines has turned back into
# a lab notebook: split it by topic or cut what is superseded.
MAX_DOC_LINES = 550


def test_no_doc_over_the_size_limit() -> None:
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines())
             for p in sorted((REPO / "docs").glob("*.md"))}
    assert sizes, "no docs found"
    over = {name: n for name, n in sizes.items() if n > MAX_DOC_LINES}
    assert not over, f"docs over {MAX_DOC_LINES} lines (split by topic, drop superseded history): {over}"


# ---------------------------------------------------------------- owned cache state
#
# Each counter and index of the cache has one owner, and every change goes through the owner's
# methods, which keep its invariants (docs/ARCHITECTURE.md, "cache/"). Field name -> the module
# allowed to assign it (``x.f = ``, ``x.f += ``, ``setattr(x, "f", ...)``, or ``f=`` in a call
# building a ``Session`` or an ``Admission``). The cache is seen only by ``server`` and the
# backend above it (the layer rule keeps ``protocol`` and ``rank`` out), so those are scanned.
OWNED_FIELDS: dict[str, str] = {
    # a rank's ledger and each admission's share of it
    **dict.fromkeys(("reserved_blocks", "running_tokens", "num_open", "worst_blocks"), "cache/ledger.py"),
    # a session's fields; the router's idle-load term depends on them
    **dict.fromkeys(("home_rank", "num_in_flight", "moved_at_s", "last_finish_s", "last_stop", "last_seen_s",
                     "context_tokens", "first_prompt_tokens", "tail_hashes", "compacting"),
                    "cache/sessions.py"),
    # an admission's use refs on its prefix (pinned, moved onto restored blocks, given back)
    "num_used_blocks": "cache/rank_admission.py",
    # the epoch, the ledgers' lifetime, L1 on/off
    **dict.fromkeys(("epoch", "ledgers", "l1_off_reason", "l1_geometry"), "cache/state.py"),
}
# Names other objects have too (``RankGroup.epoch``, ``Admission.epoch``): only assignments in
# ``cache/`` count for them, and not as a constructor's keywords.
CACHE_ONLY_FIELDS = {"epoch", "ledgers"}
OWNED_CONSTRUCTORS = {"Session", "Admission"}
# The idle-load model (``cache/idle_load.py``) changes only through its owner, ``SessionTable``.
IDLE_MODEL_OWNERS = {"cache/sessions.py", "cache/idle_load.py"}
IDLE_MODEL_CHANGES = {"update", "remove", "clear"}


def _attribute_targets(node: ast.AST) -> list[ast.Attribute]:
    if isinstance(node, ast.Attribute):
        return [node]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [a for elt in node.elts for a in _attribute_targets(elt)]
    if isinstance(node, ast.Starred):
        return _attribute_targets(node.value)
    return []


def _may_assign(rel: str, name: str) -> bool:
    owner = OWNED_FIELDS.get(name)
    return owner is None or owner == rel or (name in CACHE_ONLY_FIELDS and not rel.startswith("cache/"))


def owned_field_writes(paths: list[Path], root: Path = REPO) -> list[str]:
    """Writes of an owned field (``OWNED_FIELDS``) outside its owner, and changes of the idle-load
    model outside ``IDLE_MODEL_OWNERS``, in ``paths`` (files under ``root``)."""
    bad = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            written: list[tuple[int, str]] = []
            if isinstance(node, ast.Assign):
                written = [(a.lineno, a.attr) for t in node.targets for a in _attribute_targets(t)]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                written = [(a.lineno, a.attr) for a in _attribute_targets(node.target)]
            elif isinstance(node, ast.Call):
                func = node.func
                fname = func.id if isinstance(func, ast.Name) else func.attr if isinstance(
                    func, ast.Attribute) else ""
                if fname == "setattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                    written = [(node.lineno, str(node.args[1].value))]
                elif fname in OWNED_CONSTRUCTORS:
                    written = [(node.lineno, kw.arg) for kw in node.keywords
                               if kw.arg is not None and kw.arg not in CACHE_ONLY_FIELDS]
                elif (fname in IDLE_MODEL_CHANGES and isinstance(func, ast.Attribute)
                      and rel not in IDLE_MODEL_OWNERS):
                    target = func.value
                    if (isinstance(target, ast.Attribute) and target.attr in ("idle", "idle_load")
                            or isinstance(target, ast.Name) and target.id == "idle"):
                        bad.append(f"{rel}:{node.lineno} changes the idle-load model "
                                   f"(.{fname}; owner: cache/sessions.py)")
            bad += [f"{rel}:{line} assigns .{name} (owner: {OWNED_FIELDS[name]})"
                    for line, name in written if not _may_assign(rel, name)]
    return bad


def cache_and_its_users() -> list[Path]:
    return [REPO / "deepinfer_backend.py", *sorted((REPO / "cache").rglob("*.py")),
            *sorted((REPO / "server").rglob("*.py"))]


def test_owned_cache_fields_change_only_in_their_owner() -> None:
    bad = owned_field_writes(cache_and_its_users())
    assert not bad, "owned fields written outside their owner:\n" + "\n".join(bad)


def test_the_owner_check_sees_planted_writes() -> None:
    planted = REPO / "cache" / "_owner_probe.py"
    planted.write_text(
        "def f(s, adm, session, ledger):\n"
        "    s.ledgers[0].reserved_blocks += 1\n"
        "    adm.running_tokens, x = 3, 4\n"
        "    session.home_rank = 2\n"
        "    setattr(session, 'num_in_flight', 0)\n"
        "    s.sessions.idle.update(session, 0.0)\n"
        "    Admission(rank=0, worst_blocks=9)\n"
        "    s.epoch = 7\n"
        "    s.reserved = 1  # not an owned name\n", encoding="utf-8")
    try:
        bad = owned_field_writes([planted])
    finally:
        planted.unlink()
    lines = sorted(int(b.split(" ", 1)[0].rsplit(":", 1)[1]) for b in bad)
    assert lines == [2, 3, 4, 5, 6, 7, 8], bad
