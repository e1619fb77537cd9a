"""``request_timeout_secs`` bounds a whole request: 504 before the stream starts, an error event
in the stream's own format after, and nothing left running in the engine or held in the cache."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.config import load_config
from server.runtime import Runtime
from tests.server.server_test_helpers import run_runtime

SCRIPT = {"tokens_per_step": 1, "step_delay_s": 0.01,
          "replies": [{"name": "slow", "text": " ".join(f"w{i}" for i in range(600))}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Runtime, Any, str]]:
    script = Path(tmp_path_factory.mktemp("timeout")) / "script.json"
    script.write_text(json.dumps(SCRIPT))
    config = load_config({
        "engine": "scripted", "script_file": str(script), "ep": 1, "block_size": 16,
        "reference_num_blocks": 512, "max_num_seqs": 4, "max_model_len": 4096, "l1_cache": False,
        "port": 0, "request_timeout_secs": 1.0,
    })
    runtime = Runtime(config, rank_mode="local")
    with run_runtime(runtime) as loop:
        yield runtime, loop, runtime.url


def _idle(runtime: Runtime, loop: Any) -> None:
    deadline = time.monotonic() + 60  # a bound for a loaded machine, not a timing assert
    while runtime.group.stats(0).num_running and time.monotonic() < deadline:
        time.sleep(0.05)

    async def check() -> None:
        await runtime.cache.drain()
        runtime.group.engines[0].check_accounting()
        runtime.cache.check_balance()

    loop.call(check(), 10)
    assert runtime.group.stats(0).num_running == 0


def test_non_streaming_request_past_timeout_is_504(server: tuple[Runtime, Any, str]) -> None:
    runtime, loop, url = server
    body = {"model": "default", "max_tokens": 1000, "messages": [{"role": "user", "content": "go"}]}
    resp = httpx.post(url + "/v1/messages", json=body, timeout=30)
    assert resp.status_code == 504
    assert resp.json()["error"]["type"] == "timeout_error"
    assert "request_timeout_secs" in resp.json()["error"]["message"]
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "timeout_error"
    _idle(runtime, loop)


def test_streaming_request_past_timeout_ends_with_error_event(server: tuple[Runtime, Any, str]) -> None:
    runtime, loop, url = server
    body = {"model": "default", "max_tokens": 1000, "stream": True,
            "messages": [{"role": "user", "content": "go"}]}
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        request_id = resp.headers["x-request-id"]
        text = "".join(resp.iter_text())
    assert "event: message_start" in text and "content_block_delta" in text
    assert text.rstrip().splitlines()[-2:] == [
        "event: error", ('data: {"type":"error","error":{"type":"timeout_error","message":'
                         f'"request exceeded request_timeout_secs (1 s) (request id {request_id})"}}}}')]
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[-1][6:])["error"]["type"] == "timeout_error"
    _idle(runtime, loop)
