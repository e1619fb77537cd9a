from __future__ import annotations

import pytest

from e2e_harness import find_claude

# tests/e2e/projects/* are the projects the scenarios hand to Claude Code (their own tests run
# inside the scenario, in a temp copy), not part of this suite.
collect_ignore_glob = ["projects/*"]


@pytest.fixture(scope="session")
def claude_bin():
    binary = find_claude()
    if binary is None:
        pytest.skip("Claude Code CLI not installed: run scripts/claude_e2e.sh (it installs it with npm)")
    return binary
