"""``python -m deepinfer_backend smoke`` against a real ``python -m deepinfer_backend serve`` (scripted
engine, one rank process): every check passes and the exit status is 0 where the endpoint is
right; a wrong key or an unknown model fails the checks with the endpoint's own error and exit
status 1. (Through the SDK's ``/process``: test_backend_process_jobs.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import deepinfer_backend
from tests.server.test_backend_process_jobs import SCRIPT
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
KEY = "smoke-key"


@pytest.fixture(scope="module")
def serve_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("smoke")
    (tmp / "script.json").write_text(json.dumps(SCRIPT))
    (tmp / "key").write_text(KEY)
    config = {"block_size": 16, "reference_num_blocks": 1024, "max_num_seqs": 8, "max_model_len": 8192,
              "l1_cache": False}
    (tmp / "config.json").write_text(json.dumps(config))
    port = free_port()
    log_path = tmp / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deepinfer_backend", "serve", "--config", str(tmp / "config.json"),
             "--engine", "scripted", "--script", str(tmp / "script.json"), "--ranks", "1",
             "--port", str(port), "--api-key-file", str(tmp / "key")],
            cwd=REPO, env={**os.environ}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while "ready:" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def _smoke(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    code = deepinfer_backend.main(["smoke", *argv])
    return code, capsys.readouterr().out.strip().splitlines()


def test_smoke_passes_against_serve(serve_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _smoke(capsys, "--url", serve_url, "--key", KEY)
    assert code == 0, "\n".join(lines)
    names = [line.split(" ")[1] for line in lines[:-1]]
    assert names == ["step5-tool-call[anthropic]", "step5-tool-call[openai]", "stream[anthropic]",
                     "stream[openai]", "two-turn-cache[anthropic]", "two-turn-cache[openai]",
                     "count_tokens[anthropic]"]
    assert all(line.startswith("PASS ") for line in lines[:-1]), "\n".join(lines)
    assert 'Read {"file_path": "README.md"}' in lines[0]
    assert lines[-1] == f"smoke: 7 passed, 0 failed, 0 skipped against {serve_url}"


def test_smoke_fails_with_a_wrong_key_and_names_the_status(serve_url: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _smoke(capsys, "--url", serve_url, "--key", "wrong", "--api", "openai")
    assert code == 1
    assert [line.split(" ")[0] for line in lines[:-1]] == ["FAIL", "FAIL", "FAIL", "SKIP"]
    assert "HTTP 401" in lines[0]
    assert lines[-1].startswith("smoke: 0 passed, 3 failed, 1 skipped")


def test_smoke_reports_the_endpoints_error_for_an_unknown_model(serve_url: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _smoke(capsys, "--url", serve_url, "--key", KEY, "--api", "anthropic",
                         "--model", "claude-x")
    assert code == 1 and all(line.startswith("FAIL ") for line in lines[:-1])
    assert "HTTP 410" in lines[0] and "not_found_error" in lines[0]
