"""``setup()`` as the worker calls it: the SDK's port next to the native one, and keys the platform
may add to the workload config."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferencekey.backend import serve_backend
from inferencekey.errors import BackendSetupError

from deepinfer_backend import DeepInferBackend


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(tmp: Path, **extra: Any) -> dict[str, Any]:
    script = tmp / "script.json"
    script.write_text(json.dumps({"replies": [{"name": "hi", "text": "Hi from the script."}]}))
    return {"engine": "scripted", "script_file": str(script), "ep": 1, "block_size": 16,
            "reference_num_blocks": 256, "max_num_seqs": 4, "max_model_len": 4096, "l1_cache": False,
            "ready_timeout_secs": 120, **extra}


def test_native_port_equal_to_the_sdk_port_is_refused_naming_both(tmp_path: Path) -> None:
    port = _free_port()
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
    native = _free_port()
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
        resp = httpx.post(f"http://127.0.0.1:{sdk}/process", json={"id": "j", "input": {"prompt": "Hi"}}, timeout=60)
        assert resp.json()["output"]["text"] == "Hi from the script."
    finally:
        httpd.shutdown()
        httpd.server_close()
        backend.close()
