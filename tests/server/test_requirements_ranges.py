"""requirements.txt and pyproject's ranges against the DeepInfer venv's pins.

On the worker two venvs meet in the backend process (ours first on sys.path, then the DeepInfer
venv's) and the rank processes run the DeepInfer venv alone; so every range we declare for a
package DeepInfer pins must admit DeepInfer's version, and requirements.txt must not list the
packages the backend takes from the DeepInfer venv (they would shadow its pinned builds).
"""

from __future__ import annotations

import re

import tomllib
from packaging.requirements import Requirement

from tests.server.import_guard import REPO, requirement_lines

TAKEN_FROM_THE_DEEPINFER_VENV = {"torch", "numpy", "orjson", "pyzmq", "tokenizers"}


def _name(req: Requirement) -> str:
    return re.sub(r"[-_.]+", "-", req.name).lower()


def _pins() -> dict[str, str]:
    reqs = [Requirement(line) for line in requirement_lines(REPO / "scripts" / "deepinfer-pins.txt")]
    return {_name(r): next(iter(r.specifier)).version for r in reqs}


def _ours() -> list[Requirement]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    lines = requirement_lines(REPO / "requirements.txt") + pyproject["project"]["dependencies"]
    return [Requirement(line) for line in lines]


def test_our_ranges_admit_deepinfers_pins() -> None:
    pins = _pins()
    assert {"numpy", "orjson", "pyzmq", "tokenizers", "psutil"} <= set(pins)
    checked = []
    for req in _ours():
        if _name(req) in pins:
            pinned = pins[_name(req)]
            assert req.specifier.contains(pinned), f"{req} excludes DeepInfer's {_name(req)}=={pinned}"
            checked.append(_name(req))
    assert {"numpy", "orjson", "pyzmq", "tokenizers", "psutil"} <= set(checked)


def test_requirements_txt_leaves_the_deepinfer_venvs_packages_out() -> None:
    listed = {_name(Requirement(line)) for line in requirement_lines(REPO / "requirements.txt")}
    assert not listed & TAKEN_FROM_THE_DEEPINFER_VENV
