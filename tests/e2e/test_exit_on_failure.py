"""A rank group that cannot come back ends the backend's process, so the worker's supervisor sees it.

The SDK's ``python -m inferencekey.backend.serve`` answers ``/healthz`` 200 for as long as it
lives; before, a rank group whose restarts were spent stayed FAILED inside a process that looked
healthy. Now the backend stops (ranks, L1 pool file) and exits with status 3 and one line on
stderr (``server/exit_on_failure.py``), and the next backend on the same ``l2_dir`` serves the old
session warm (every finished turn was written through to L1 and spilled to L2).

Real pieces: the SDK's serve (and ``python -m deepinfer_backend serve``) as a subprocess, 2 CPU rank
processes of the reference engine (``null`` model), ``rank_max_restarts`` lowered so that two kills
spend the budget (one for the CLI), requests over the native HTTP server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.e2e.e2e_harness import API_KEY, REPO, Backend
from tests.e2e.test_warm_restart import _cached_share, _first_turn, _next_turn, _wait_restarted
from tests.support.ports import free_port
from tests.support.sdk_serve import wait_healthz

pytestmark = pytest.mark.timeout(900)

EXIT_BOUND_S = 120.0  # the backend's own bound is 60 s of cleanup (+10 s hard exit); generous here


def _config(l2_dir: Path, **extra: Any) -> dict[str, Any]:
    return {"engine": "reference", "reference_model": "null", "ep": 2, "block_size": 16,
            "reference_num_blocks": 2048, "max_model_len": 3800, "max_num_batched_tokens": 4096,
            "l1_host_gb": 0.05, "l2_dir": str(l2_dir), "l2_gb": 0.5, "api_key": API_KEY,
            "ready_timeout_secs": 300, **extra}


def _sdk_serve(config: dict[str, Any], timeout_s: float = 300) -> tuple[Backend, Path]:
    """The SDK's serve with our backend; returns it as a ``Backend`` (native URL) and its stderr file."""
    workdir = Path(tempfile.mkdtemp(prefix="e2e-sdk-"))
    sdk_port, http_port = free_port(), free_port()
    log_path, err_path = workdir / "serve.log", workdir / "serve.err"
    with log_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "inferencekey.backend.serve", "--port", str(sdk_port),
             "--backend", "deepinfer_backend:DeepInferBackend",
             "--config-json", json.dumps({**config, "port": http_port})],
            cwd=workdir, env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
            stdout=out, stderr=err, start_new_session=True)
    backend = Backend(proc, f"http://127.0.0.1:{http_port}", err_path, workdir)
    wait_healthz(f"http://127.0.0.1:{sdk_port}", proc, err_path, timeout_s)
    backend.wait_ready(60)
    return backend, err_path


@pytest.fixture
def started() -> Iterator[list[Backend]]:
    backends: list[Backend] = []
    yield backends
    for backend in backends:
        if backend.proc.poll() is None:
            os.killpg(backend.proc.pid, signal.SIGKILL)
            backend.proc.wait(30)


def _kill_ranks(backend: Backend) -> list[int]:
    pids = backend.rank_pids()
    assert len(pids) == 2, pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def _assert_nothing_left(pid: int) -> None:
    ranks = [p.pid for p in psutil.process_iter(["cmdline"])
             if f"--parent-pid {pid}" in " ".join(p.info["cmdline"] or [])]
    assert not ranks, f"rank processes left behind: {ranks}"
    pools = list(Path("/dev/shm").glob(f"dib-l1-g{pid}-*"))
    assert not pools, f"L1 pool files left behind: {pools}"


def _wait_exit(backend: Backend) -> tuple[int, float]:
    started = time.monotonic()
    code = backend.proc.wait(timeout=EXIT_BOUND_S)
    return code, time.monotonic() - started


def test_sdk_serve_exits_when_the_restart_budget_is_spent_and_the_next_one_is_warm(
    tmp_path: Path, started: list[Backend]
) -> None:
    l2_dir = tmp_path / "l2"
    backend, err_path = _sdk_serve(_config(l2_dir, rank_max_restarts=1))
    started.append(backend)
    history, _, _ = _first_turn(backend, seed=21)
    time.sleep(2.0)
    _wait_restarted(backend, _kill_ranks(backend))  # the one restart the budget allows
    _kill_ranks(backend)  # one too many
    code, took = _wait_exit(backend)
    last_line = err_path.read_text().strip().splitlines()[-1]
    print(f"\nSDK serve exited with status {code} {took:.1f} s after the second rank kill: {last_line}")
    assert code == 3, err_path.read_text()[-3000:]
    assert "exiting with status 3" in last_line and "restart budget spent" in last_line
    _assert_nothing_left(backend.proc.pid)

    again, _ = _sdk_serve(_config(l2_dir))
    started.append(again)
    usage, _ = _next_turn(again, history)
    share = _cached_share(usage)
    print(f"new SDK serve on the same l2_dir: {usage['prompt_tokens_details']['cached_tokens']} of "
          f"{usage['prompt_tokens']} cached ({share:.1%})")
    assert share >= 0.9


def test_cli_serve_exits_non_zero_when_the_rank_group_fails(tmp_path: Path, started: list[Backend]) -> None:
    script = tmp_path / "unused-script.txt"
    script.write_text("")
    config = _config(tmp_path / "l2", rank_max_restarts=0)
    del config["ep"]
    backend = Backend.start(script, ranks=2, config=config, timeout_s=300)
    started.append(backend)
    _kill_ranks(backend)
    code, took = _wait_exit(backend)
    last_line = backend.log_text().strip().splitlines()[-1]
    print(f"\nCLI serve exited with status {code} {took:.1f} s after the rank kill: {last_line}")
    assert code == 3, backend.log_text()[-3000:]
    assert "exiting with status 3" in last_line and "restart budget spent" in last_line
    _assert_nothing_left(backend.proc.pid)


def test_cli_serve_exits_when_a_new_group_cannot_start(tmp_path: Path, started: list[Backend]) -> None:
    """The other way a group cannot come back: the restart after a rank kill never gets ready (here
    the ranks' interpreter is gone; on a worker, a broken driver or a full disk). Three failed
    starts in a row and the process exits 3, whatever rank_max_restarts allows."""
    venv = tmp_path / "rank-venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"  # a wrapper: a symlink would lose the venv's site-packages
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    script = tmp_path / "unused-script.txt"
    script.write_text("")
    config = _config(tmp_path / "l2", deepinfer_venv=str(venv))  # the ranks run its interpreter
    del config["ep"]
    backend = Backend.start(script, ranks=2, config=config, timeout_s=300)
    started.append(backend)
    python.unlink()
    _kill_ranks(backend)
    code, took = _wait_exit(backend)
    last_line = backend.log_text().strip().splitlines()[-1]
    print(f"\nCLI serve exited with status {code} {took:.1f} s after the rank kill: {last_line}")
    assert code == 3, backend.log_text()[-3000:]
    assert "exiting with status 3" in last_line and "3 failed starts in a row" in last_line
    assert "could not launch ranks" in last_line and str(python) in last_line, last_line
    _assert_nothing_left(backend.proc.pid)
