"""requirements.lock against requirements.txt, DeepInfer's pins and the published archive.

The worker builds the backend venv from the archive's requirements.txt, which publish.py fills
with requirements.lock (scripts/lock_requirements.py regenerates it): every name exact, every
version inside requirements.txt's range and equal to DeepInfer's pin where both venvs hold it.
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import publish
from tests.server.import_guard import REPO, requirement_lines
from tests.server.test_requirements_ranges import TAKEN_FROM_THE_DEEPINFER_VENV

LOCK_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s#;]+)$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """name -> version, and name -> what needs it (the ``# via`` line under each pin)."""
    pins: dict[str, str] = {}
    via: dict[str, list[str]] = {}
    last = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("# via "):
            via[last] = [v.strip() for v in line[len("# via "):].split(",")]
            continue
        if not line or line.startswith("#"):
            continue
        match = LOCK_LINE.match(line)
        assert match, f"requirements.lock: {line!r} is not an exact name==version pin"
        last = _norm(match.group(1))
        pins[last] = match.group(2)
    return pins, via


def lock_problems(requirements: list[str], lock_text: str, deepinfer_pins: dict[str, str]) -> list[str]:
    """Every disagreement between requirements.txt's lines, the lock and DeepInfer's pins."""
    pins, via = parse_lock(lock_text)
    reqs = {_norm(Requirement(line).name): Requirement(line) for line in requirements}
    problems = []
    for name, req in reqs.items():
        if name not in pins:
            problems.append(f"{name} is in requirements.txt but not in the lock")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"lock {name}=={pins[name]} is outside requirements.txt's {req.specifier}")
    for name, version in pins.items():
        needed_by = [v for v in via.get(name, []) if v != "-r requirements.txt"]
        if name not in reqs and not any(_norm(v) in pins for v in needed_by):
            problems.append(f"{name} is in the lock but neither in requirements.txt nor needed by a "
                            "locked package")
        if name in deepinfer_pins and deepinfer_pins[name] != version:
            problems.append(f"lock {name}=={version} contradicts DeepInfer's pin {deepinfer_pins[name]}")
        if name in TAKEN_FROM_THE_DEEPINFER_VENV:
            problems.append(f"lock {name} would shadow the DeepInfer venv's build")
    return problems


def _deepinfer_pins() -> dict[str, str]:
    reqs = [Requirement(line) for line in requirement_lines(REPO / "scripts" / "deepinfer-pins.txt")]
    return {_norm(r.name): next(iter(r.specifier)).version for r in reqs}


def test_lock_agrees_with_requirements_and_deepinfer_pins() -> None:
    lock = (REPO / "requirements.lock").read_text(encoding="utf-8")
    assert lock_problems(requirement_lines(REPO / "requirements.txt"), lock, _deepinfer_pins()) == []
    pins, _ = parse_lock(lock)
    assert {"pydantic", "starlette", "uvicorn", "psutil"} <= set(pins)


@pytest.mark.parametrize(("requirements", "lock", "expected"), [
    (["xxhash>=3.4", "psutil>=5.9"], "xxhash==4.1.0\n    # via -r requirements.txt\n",
     "psutil is in requirements.txt but not in the lock"),
    (["xxhash>=3.4"],
     "xxhash==4.1.0\n    # via -r requirements.txt\nrich==13.0\n    # via -r requirements.txt\n",
     "rich is in the lock but neither"),
    (["pydantic>=2.6,<3"], "pydantic==3.0.1\n    # via -r requirements.txt\n", "outside requirements.txt's"),
    (["psutil>=5.9"], "psutil==7.0.0\n    # via -r requirements.txt\n", "contradicts DeepInfer's pin 7.2.2"),
    (["xxhash>=3.4"], "xxhash==4.1.0\n    # via -r requirements.txt\nnumpy==2.3.5\n    # via xxhash\n",
     "would shadow"),
])
def test_lock_check_catches_each_disagreement(requirements: list[str], lock: str, expected: str) -> None:
    problems = lock_problems(requirements, lock, {"psutil": "7.2.2", "numpy": "2.3.5"})
    assert any(expected in p for p in problems), problems


def test_lock_check_refuses_a_range_in_the_lock() -> None:
    with pytest.raises(AssertionError, match="not an exact"):
        parse_lock("pydantic>=2.6\n")


def test_archive_requirements_are_the_lock(tmp_path: Path) -> None:
    pkg, names = publish.build_package("9.9.9", "deepinfer-v41-flash", str(tmp_path), "3.12")
    assert "requirements.txt" in names
    with tarfile.open(pkg.path) as tar:  # type: ignore[attr-defined]
        shipped = tar.extractfile("requirements.txt").read().decode()  # type: ignore[union-attr]
    assert shipped == (REPO / "requirements.lock").read_text(encoding="utf-8")
    assert parse_lock(shipped)[0]["pydantic"]
