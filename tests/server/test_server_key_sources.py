"""The API key from a file or an environment variable (``--api-key`` shows in
``ps``), and ``/metrics`` behind the key on request (``metrics_require_key``).

Red before: there was no ``api_key_file`` key, no ``--api-key-file`` flag, no
``DEEPINFER_API_KEY`` and no ``metrics_require_key``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.loop_stall_bench import start_server, stop_server
from server.app import AppState, HealthReport, create_app
from server.config import API_KEY_ENV, ConfigError, load_config
from server.metrics import ServerMetrics
from tests.server.server_test_helpers import serve_asgi

KEY = "sk-file-key-5e1f0a7d2c"


def _serve(config: dict[str, object]) -> Iterator[str]:
    state = AppState(config=load_config(config), metrics=ServerMetrics(),
                     health=lambda: HealthReport("ready", [], []))
    with serve_asgi(create_app(state)) as url:
        yield url


@pytest.fixture()
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return path


def test_key_from_a_file_guards_the_routes(key_file: Path) -> None:
    for url in _serve({"api_key_file": str(key_file), "metrics_require_key": True}):
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
        unauth = httpx.get(url + "/metrics")
        assert unauth.status_code == 401 and unauth.json()["error"]["type"] == "authentication_error"
        assert KEY not in unauth.text
        assert httpx.get(url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).status_code == 200


def test_metrics_stay_open_by_default(key_file: Path) -> None:
    for url in _serve({"api_key_file": str(key_file)}):
        assert httpx.get(url + "/metrics").status_code == 200


def test_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "sk-env-key")
    assert load_config({}).resolved_api_key() == "sk-env-key"
    assert load_config({"api_key": "sk-config"}).resolved_api_key() == "sk-config"  # config wins
    for url in _serve({}):
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"x-api-key": "sk-env-key"}).status_code == 200
    monkeypatch.delenv(API_KEY_ENV)
    assert load_config({}).resolved_api_key() is None


def test_bad_key_sources_fail_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"api_key": "sk-secret-in-config", "api_key_file": str(tmp_path / "k")})
    assert "api_key_file" in str(err.value) and "sk-secret-in-config" not in str(err.value)
    with pytest.raises(ConfigError, match="api_key_file"):
        load_config({"api_key_file": str(tmp_path / "missing")}).resolved_api_key()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config({"api_key_file": str(tmp_path / "empty")}).resolved_api_key()


def test_serve_with_a_key_file_keeps_the_key_out_of_ps(tmp_path: Path, key_file: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    proc, url = start_server(tmp_path, {"reference_num_blocks": 64, "block_size": 16, "max_model_len": 4096},
                             ("--api-key-file", str(key_file)), env)
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert KEY.encode() not in cmdline and b"--api-key-file" in cmdline
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
        assert KEY not in (tmp_path / "serve.log").read_text(errors="replace")
    finally:
        stop_server(proc)
