from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.e2e_harness import Backend, find_claude, running_backend

# tests/e2e/projects/* are the projects the scenarios hand to Claude Code (their own tests run
# inside the scenario, in a temp copy), not part of this suite.
collect_ignore_glob = ["projects/*"]


@pytest.fixture(scope="session")
def claude_bin():
    binary = find_claude()
    if binary is None:
        pytest.skip("Claude Code CLI not installed: run scripts/claude_e2e.sh (it installs it with npm)")
    return binary


@pytest.fixture(scope="session")
def shared_backend():
    """One backend for every CLI scenario that needs no special config (scenarios/shared.json
    includes their scripts, each scoped to a phrase of its prompt): saves a start per scenario."""
    with running_backend("shared.json") as backend:
        yield backend


@pytest.fixture
def backends() -> Iterator[list[Backend]]:
    """Backends a test starts (``_start`` in test_warm_restart.py); each is stopped at the end."""
    started: list[Backend] = []
    yield started
    for backend in started:
        backend.stop()
