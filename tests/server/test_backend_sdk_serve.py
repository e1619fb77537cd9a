"""The SDK's own ``serve`` starts ``DeepInferBackend`` (real rank processes) and answers /process;
the backend's native HTTP endpoint runs alongside. Also the in-process ``serve_backend`` API with
``chat()`` streaming, ``setup()`` refusing a bad config by key, the SDK's port next to the native
one, and keys the platform may add to the workload config."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import psutil
import pytest
from inferencekey.backend import BackendContext, serve_backend
from inferencekey.errors import BackendSetupError

from deepinfer_backend import DeepInferBackend
from server.config import ConfigError
from tests.support.ports import free_port
from tests.support.sdk_serve import wait_healthz

REPO = Path(__file__).resolve().parents[2]
SCRIPT = {"replies": [{"name": "hello", "text": "Hello from the scripted model."}]}



def _config(tmp: Path, **extra: Any) -> dict[str, Any]:
    script = tmp / "script.json"
    script.write_text(json.dumps(SCRIPT))
    return {"engine": "scripted", "script_file": str(script), "ep": 1, "block_size": 16,
            "reference_num_blocks": 1024, "max_num_seqs": 8, "max_model_len": 4096, "l1_cache": False,
            "ready_timeout_secs": 120, **extra}


@pytest.fixture(scope="module")
def sdk_server(
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    tmp = tmp_path_factory.mktemp("sdk")
    sdk_port, http_port = free_port(), free_port()
    config = _config(tmp, port=http_port, api_key="k-native")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = (tmp / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferencekey.backend.serve", "--port", str(sdk_port),
         "--backend", "deepinfer_backend:DeepInferBackend", "--config-json", json.dumps(config)],
        cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    sdk_url = f"http://127.0.0.1:{sdk_port}"
    wait_healthz(sdk_url, proc, tmp / "serve.log", 180)
    try:
        yield sdk_url, f"http://127.0.0.1:{http_port}", proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


def test_sdk_process_answers_messages_and_prompt(sdk_server: tuple[str, str, Any]) -> None:
    sdk_url = sdk_server[0]
    for job_input in ({"messages": [{"role": "user", "content": "Say hello."}]}, {"prompt": "Say hello."}):
        resp = httpx.post(sdk_url + "/process", json={"id": "j1", "input": job_input}, timeout=60)
        assert resp.status_code == 200, resp.text
        output = resp.json()["output"]
        assert output["text"] == "Hello from the scripted model."
        assert output["response"]["object"] == "chat.completion"
        assert output["finish_reason"] == "stop" and output["usage"]["completion_tokens"] > 0
    meta = httpx.get(sdk_url + "/meta").json()
    assert meta["name"] == "deepinfer-v41-flash" and meta["task_type"] == "text2text"


def test_sdk_process_malformed_input_is_400(sdk_server: tuple[str, str, Any]) -> None:
    sdk_url = sdk_server[0]
    resp = httpx.post(sdk_url + "/process", json={"id": "j2", "input": {}})
    assert resp.status_code == 400 and "messages" in resp.json()["error"]
    resp = httpx.post(sdk_url + "/process", json={"id": "j3", "input": {
        "model": "claude-opus-4-8", "messages": [{"role": "user", "content": "x"}]}})
    assert resp.status_code == 400  # the error text is the OpenAI error body (an OpenAI-shaped job)
    assert json.loads(resp.json()["error"])["error"]["message"] == (
        "Model 'claude-opus-4-8' is not available on this endpoint")


def test_native_http_runs_next_to_sdk_and_sigterm_stops_ranks(sdk_server: tuple[str, str, Any]) -> None:
    _, http_url, proc = sdk_server
    with anthropic.Anthropic(base_url=http_url, api_key="k-native", max_retries=0) as client:
        msg = client.messages.create(model="default", max_tokens=32,
                                     messages=[{"role": "user", "content": "Hi"}])
    assert msg.content[0].text == "Hello from the scripted model."
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "expected rank processes"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    _, alive = psutil.wait_procs(children, timeout=20)
    assert not alive, f"rank processes left behind: {alive}"


def test_setup_rejects_unknown_key_naming_it(tmp_path: Path) -> None:
    backend = DeepInferBackend()
    with pytest.raises(ConfigError, match="unknown config key 'l1_host_gib'"):
        backend.setup(BackendContext(config={"l1_host_gib": 4}, port=0))
    with pytest.raises(BackendSetupError, match="config key 'ep'"):
        serve_backend(DeepInferBackend, port=0, config={"ep": 0}, block=False)


def test_serve_backend_python_api_streams_chat_chunks(tmp_path: Path) -> None:
    config = _config(tmp_path, env={"IK_BACKEND_HTTP": "sdk"})
    backend = DeepInferBackend()
    httpd, _state = serve_backend(backend, port=0, config=config, block=False)
    try:
        chunks = list(backend.chat({"model": "default", "messages": [{"role": "user", "content": "Hi"}]}))
        assert chunks[0]["object"] == "chat.completion.chunk"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
        assert text == "Hello from the scripted model."
        resp = httpx.post(f"http://127.0.0.1:{httpd.server_address[1]}/process",
                          json={"id": "j", "input": {"prompt": "Hi"}}, timeout=60)
        assert resp.json()["output"]["text"] == "Hello from the scripted model."
    finally:
        httpd.shutdown()
        httpd.server_close()
        backend.close()


def test_native_port_equal_to_the_sdk_port_is_refused_naming_both(tmp_path: Path) -> None:
    port = free_port()
    with pytest.raises(BackendSetupError, match=f"config key 'port': {port} is the SDK server's own port"):
        serve_backend(DeepInferBackend, port=port, config=_config(tmp_path, port=port), block=False)


def test_native_port_in_use_fails_naming_the_key(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(BackendSetupError, match=f"127.0.0.1:{port}.*(in use|config keys host/port)"):
            serve_backend(DeepInferBackend, port=0, config=_config(tmp_path, port=port), block=False)


def test_sdk_and_native_servers_on_their_own_ports_and_unknown_keys_warn(tmp_path: Path) -> None:
    native = free_port()
    backend = DeepInferBackend()
    httpd, _ = serve_backend(backend, port=0, config=_config(tmp_path, port=native, ik_platform_key="x"),
                             block=False)
    try:
        sdk = httpd.server_address[1]
        assert sdk != native
        assert httpx.get(f"http://127.0.0.1:{sdk}/healthz").json() == {"status": "ok"}
        health = httpx.get(f"http://127.0.0.1:{native}/healthz").json()
        assert "config key 'ik_platform_key' is not one of this backend's keys; ignored" in health["warnings"]
        assert httpx.post(f"http://127.0.0.1:{native}/process", json={}).status_code == 404  # SDK route only
        resp = httpx.post(f"http://127.0.0.1:{sdk}/process", json={"id": "j", "input": {"prompt": "Hi"}},
                          timeout=60)
        assert resp.json()["output"]["text"] == "Hello from the scripted model."
    finally:
        httpd.shutdown()
        httpd.server_close()
        backend.close()


@pytest.mark.timeout(180)
def test_sigterm_while_loading_stops_the_ranks_and_leaves_nothing(tmp_path: Path) -> None:
    """A deploy cancelled while the model loads: the SDK has no SIGTERM handler yet, so without ours
    the process died at once, leaving the rank group's temp directory and /dev/shm pool."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    config = {"engine": "reference", "ep": 2, "block_size": 16, "reference_num_blocks": 64,
              "max_num_batched_tokens": 256, "l1_host_gb": 0.01, "port": 0}
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "inferencekey.backend.serve", "--port", str(free_port()), "--backend",
             "deepinfer_backend:DeepInferBackend"], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmpdir),
                 "IK_BACKEND_CONFIG": json.dumps(config)})
    try:
        # the ranks are still importing torch
        while "started rank 1 (pid" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.02)
        ranks = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 1  # setup() failed: the SDK exits non-zero
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log_path.read_text(errors="replace")
    assert "SetupInterrupted: signal 15 while loading" in text, text[-3000:]
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive
    assert not [n for n in os.listdir("/dev/shm") if f"-g{proc.pid}-" in n]
    assert list(tmpdir.iterdir()) == []
