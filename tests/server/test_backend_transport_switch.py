"""``env.IK_BACKEND_HTTP``, every value, under the SDK's in-process ``serve_backend``: unset and
``native`` run the native server on ``host:port`` beside the SDK's, ``sdk`` runs none; the SDK's
``/process`` answers in all three (the platform reaches only that); one log line says which; a
process-environment value is not read (a warning says so); anything else is refused naming the
key. With ``sdk``, a ``/process`` job past ``request_timeout_secs`` is cancelled and leaves nothing
running or held."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from inferencekey.backend import serve_backend
from inferencekey.errors import BackendSetupError

import deepinfer_backend
from deepinfer_backend import DeepInferBackend
from tests.support.ports import free_port

SCRIPT = {"tokens_per_step": 1, "step_delay_s": 0.02, "replies": [
    {"name": "slow", "match": "go slow", "text": " ".join(f"w{i}" for i in range(600))}],
    "default": {"text": "Hello from the scripted model."}}


def _config(tmp: Path, **extra: Any) -> dict[str, Any]:
    script = tmp / "script.json"
    script.write_text(json.dumps(SCRIPT))
    return {"engine": "scripted", "script_file": str(script), "ep": 1, "block_size": 16,
            "reference_num_blocks": 1024, "max_num_seqs": 8, "max_model_len": 4096, "l1_cache": False,
            "ready_timeout_secs": 120, **extra}


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture()
def started(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Any]:
    """``start(env, **config)`` -> (backend, SDK URL, native port, transport log line)."""
    running: list[tuple[Any, DeepInferBackend]] = []

    def start(env: dict[str, str] | None, **extra: Any) -> tuple[DeepInferBackend, str, int, str]:
        native = free_port()
        config = _config(tmp_path, port=native, **({"env": env} if env is not None else {}), **extra)
        backend = DeepInferBackend()
        with caplog.at_level(logging.INFO, logger="deepinfer.backend"):
            httpd, _ = serve_backend(backend, port=0, config=config, block=False)
        running.append((httpd, backend))
        line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("setup: transport:")]
        assert len(line) == 1, caplog.text
        caplog.clear()
        return backend, f"http://127.0.0.1:{httpd.server_address[1]}", native, line[0]

    yield start
    for httpd, backend in running:
        httpd.shutdown()
        httpd.server_close()
        backend.close()


def _process_text(sdk_url: str) -> str:
    resp = httpx.post(sdk_url + "/process", json={"id": "t", "input": {"prompt": "Hi"}}, timeout=60)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["output"]["text"])


def test_unset_runs_the_native_server_and_ignores_the_process_environment(
        started: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IK_BACKEND_HTTP", "sdk")  # not the switch: the config's env is
    _backend, sdk_url, native, line = started(None)
    sdk_port = sdk_url.rsplit(":", 1)[1]
    assert line == (f"setup: transport: platform -> SDK POST /process on 127.0.0.1:{sdk_port}; "
                    f"IK_BACKEND_HTTP unset (= native): native HTTP server on 127.0.0.1:{native} for "
                    "local/direct use")
    assert _process_text(sdk_url) == "Hello from the scripted model."
    health = httpx.get(f"http://127.0.0.1:{native}/healthz").json()
    assert health["status"] in ("ready", "degraded")  # degraded: L1 off here
    assert ("the process environment's IK_BACKEND_HTTP='sdk' is not read; the switch is the workload "
            "config's env.IK_BACKEND_HTTP (now 'native')") in health["warnings"]


def test_native_runs_the_native_server_beside_the_sdk(started: Any) -> None:
    _backend, sdk_url, native, line = started({"IK_BACKEND_HTTP": "native"})
    assert line.endswith(
        f"IK_BACKEND_HTTP=native: native HTTP server on 127.0.0.1:{native} for local/direct use")
    assert _process_text(sdk_url) == "Hello from the scripted model."
    resp = httpx.post(f"http://127.0.0.1:{native}/v1/chat/completions", timeout=60, json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}]})
    assert resp.json()["choices"][0]["message"]["content"] == "Hello from the scripted model."


def test_sdk_runs_no_native_server_and_a_job_past_its_timeout_is_cancelled(started: Any) -> None:
    backend, sdk_url, native, line = started({"IK_BACKEND_HTTP": "sdk"}, request_timeout_secs=2)
    assert line.endswith("IK_BACKEND_HTTP=sdk: no native HTTP server")
    assert not _listening(native)
    assert _process_text(sdk_url) == "Hello from the scripted model."
    resp = httpx.post(sdk_url + "/process", timeout=60, json={"id": "slow", "input": {
        "api": "anthropic", "max_tokens": 1000, "messages": [{"role": "user", "content": "go slow"}]}})
    assert resp.status_code == 500
    assert json.loads(resp.json()["error"]) == {"type": "error", "error": {
        "type": "timeout_error", "message": "request exceeded request_timeout_secs (2 s)"}}
    runtime, loop = backend._require_ready()
    deadline = time.monotonic() + 60  # a bound for a loaded machine, not a timing assert
    while runtime.group.stats(0).num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = runtime.group.stats(0)
    assert stats.num_running == 0 and stats.num_waiting == 0  # the engine request was aborted

    async def balanced() -> None:
        await runtime.cache.drain()
        runtime.cache.check_balance()  # no turn left open, every reference released

    loop.call(balanced(), 30)
    assert _process_text(sdk_url) == "Hello from the scripted model."


def test_any_other_value_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(BackendSetupError,
                       match=r"env.IK_BACKEND_HTTP must be one of native, sdk, got 'grpc'"):
        serve_backend(DeepInferBackend, port=0, config=_config(tmp_path, env={"IK_BACKEND_HTTP": "grpc"}),
                      block=False)


def test_serve_cli_refuses_sdk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.json"
    config.write_text(json.dumps(_config(tmp_path, env={"IK_BACKEND_HTTP": "sdk"})))
    assert deepinfer_backend.main(["serve", "--config", str(config)]) == 2
    assert "env.IK_BACKEND_HTTP=sdk would leave nothing to serve" in capsys.readouterr().err
