"""Waiting for the SDK's ``python -m inferencekey.backend.serve`` a test started."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest


def wait_healthz(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Until ``url``'s ``/healthz`` answers 200. Fails with the tail of ``log`` when the process
    exits first, or kills it and fails when ``timeout_s`` runs out (a bound for a loaded machine,
    not a timing assert)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail("SDK serve exited before it was ready: " + log.read_text()[-4000:])
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    pytest.fail("SDK serve did not become ready: " + log.read_text()[-4000:])
