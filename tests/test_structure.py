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
import itertools
import re
import subprocess
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
    """The checkout's own text files: tracked or new, never what git ignores (venvs, caches,
    installed agent clients), so a developer's machine checks what a clone has."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=REPO, check=True, capture_output=True).stdout.decode().split("\0")
        candidates = [REPO / name for name in listed if name]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked archive)
        candidates = list(REPO.rglob("*"))
    return [p for p in sorted(candidates)
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
        listed = repository_text_files()  # a new, not yet committed doc is checked too
        bad = unreadable_references([planted])
    finally:
        planted.unlink()
    assert planted in listed
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


# ---------------------------------------------------------------------------------------------
# No import cycle at run time. The layer rule above keeps imports pointing down between layers;
# inside a layer (and through a lazy import that routes back up, into the stand-ins for example)
# two modules can still need each other. A cycle works only while every import in it stays lazy
# or the modules happen to be imported in one order; it is a seam that was never drawn. So the
# graph of run-time imports of the product (and the stand-ins it routes into) must have none.
# What counts: every import statement at module level or inside a function, and
# ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name. What does not:
# imports under ``if TYPE_CHECKING:`` (never run). A call to ``import_module`` whose name is not a
# literal must be declared here with the modules it may import, so that its route is in the graph.
GRAPH_PACKAGES = (*PRODUCT, "standins")
DYNAMIC_IMPORTS: dict[str, tuple[str, ...]] = {
    # DIB_DEEPINFER_MODULE (tests only): the stand-in for DeepInfer's Python API
    "rank/engines.py": ("standins.fake_deepinfer_lockstep",),
    # DIB_TEST_ENGINE_WRAPPER (tests only): a wrapper around the rank's engine
    "rank/rank_setup.py": ("standins.step_gate",),
}
_IMPORT_FUNCS = {"import_module", "__import__"}


def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    """(line, dotted name) of every import the module may run: import statements anywhere but
    under ``if TYPE_CHECKING:``, and ``import_module``/``__import__`` calls with a literal name.
    A call with any other argument raises unless ``DYNAMIC_IMPORTS`` lists the file's routes."""
    rel = path.relative_to(root)
    package = rel.with_suffix("").parts[:-1]
    out: list[tuple[int, str]] = []
    unresolved: list[int] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            out.extend((node.lineno, f"{name}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in _IMPORT_FUNCS and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    name = arg.value
                    if name.startswith("."):  # relative to the literal package argument
                        anchor = node.args[1] if len(node.args) > 1 else None
                        if isinstance(anchor, ast.Constant) and isinstance(anchor.value, str):
                            name = anchor.value + name
                    out.append((node.lineno, name.lstrip(".")))
                else:
                    unresolved.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    if unresolved:
        routes = DYNAMIC_IMPORTS.get(str(rel))
        if routes is None:
            raise AssertionError(f"{rel}:{unresolved[0]}: import_module of a computed name; declare "
                                 "the modules it may import in DYNAMIC_IMPORTS")
        out.extend((unresolved[0], name) for name in routes)
    return out


def import_graph(paths: list[Path], root: Path = REPO) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first import}, over the modules in ``paths``.
    ``a.b.c`` imports the packages ``a`` and ``a.b`` too (their ``__init__`` runs first)."""
    known = {module_name(p, root) for p in paths}
    graph: dict[str, dict[str, int]] = {}
    for path in paths:
        edges = graph.setdefault(module_name(path, root), {})
        for line, name in runtime_imports(path, root):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in known:
                    edges.setdefault(target, line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (first module repeated last) per strongly connected component that has one
    (Tarjan's algorithm, iterative), each from its alphabetically first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    components.append(component)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside it)."""
    first = min(component)
    came_from: dict[str, str] = {}
    frontier = [first]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child not in component:
                    continue
                if child == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), first]
                if child not in came_from:
                    came_from[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {first} in {sorted(component)}")


def describe_cycle(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    """``a:12 -> b:3 -> a``: module ``a`` imports ``b`` at its line 12, ``b`` imports ``a`` at 3."""
    return "  " + " -> ".join(f"{a}:{graph[a][b]}" for a, b in itertools.pairwise(cycle)) + f" -> {cycle[-1]}"


def graph_files() -> list[Path]:
    files = product_files()
    for package in GRAPH_PACKAGES:
        if package not in PRODUCT:
            files += sorted((REPO / package).rglob("*.py"))
    return files


def test_no_import_cycle_at_run_time() -> None:
    graph = import_graph(graph_files())
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(describe_cycle(graph, c) for c in cycles)


def test_the_cycle_check_sees_lazy_and_importlib_routes_but_not_type_checking(tmp_path: Path) -> None:
    """A cycle closed by an import inside a function and an ``importlib.import_module`` route is
    found; an edge back under ``TYPE_CHECKING`` is not a cycle; a computed module name must be
    declared."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    sources = {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg import b\n    return b\n",
        "b.py": "import importlib\ndef g():\n    return importlib.import_module('pkg.c')\n",
        "c.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n"
                 "from .a import f\n"),
        "d.py": "from pkg import c\n",
    }
    for name, text in sources.items():
        (pkg / name).write_text(text, encoding="utf-8")
    files = sorted(pkg.glob("*.py"))
    graph = import_graph(files, tmp_path)
    cycles = import_cycles(graph)
    assert cycles == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]], cycles
    assert describe_cycle(graph, cycles[0]) == "  pkg.a:2 -> pkg.b:3 -> pkg.c:4 -> pkg.a"
    (pkg / "e.py").write_text("import importlib\nNAME = 'pkg.a'\nimportlib.import_module(NAME)\n")
    with pytest.raises(AssertionError, match="pkg/e.py:3: import_module of a computed name"):
        import_graph([*files, pkg / "e.py"], tmp_path)


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
