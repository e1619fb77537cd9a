"""A client that goes away ends its engine request, on every chat route, streaming or not.

A non-streaming request whose client left at 120 s ran 352 s (181K tokens);
nobody watched the connection while ``service.complete`` ran. Here each route and mode starts a
reply far longer than the test lets it run (null model, ``ignore`` of EOS: it never stops by
itself), the raw-socket client waits until the engine runs it, then closes the connection. The
engine must end the request (aborted, well short of ``max_tokens``), the service must count it
as cancelled, and every block must be back (``settle`` checks the balances).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.support.runtime_thread import RuntimeThread

MAX_TOKENS = 100_000  # ~10 s of null-model decode on this machine: far past the disconnect
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def rt() -> Iterator[RuntimeThread]:
    config = {"engine": "reference", "reference_model": "null", "ep": 1, "block_size": 128,
              "reference_num_blocks": 1024, "max_model_len": 131_072, "l1_cache": False, "port": 0,
              "request_timeout_secs": 600}
    with RuntimeThread(config, rank_mode="local") as handle:
        yield handle


def _request(path: str, body: dict[str, object], port: int) -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode()
    return head + data


def _sample(rt: RuntimeThread, name: str, labels: dict[str, str] | None = None) -> float:
    return rt.runtime.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def _wait_running(rt: RuntimeThread, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(rt.cache_sizes()["running"]) == 0:
        assert time.monotonic() < deadline, "the engine never started the request"
        time.sleep(0.01)


@pytest.mark.parametrize("path,stream", [
    ("/v1/messages", False), ("/v1/messages", True),
    ("/v1/chat/completions", False), ("/v1/chat/completions", True),
    ("/v1/responses", False), ("/v1/responses", True),
])
def test_client_gone_aborts_the_engine_request(rt: RuntimeThread, path: str, stream: bool) -> None:
    text = f"write forever {path} {stream}"
    body: dict[str, object] = {"model": "default", "stream": stream}
    if path == "/v1/responses":
        body.update(max_output_tokens=MAX_TOKENS, input=text)
    else:
        body.update(max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": text}])
    port = int(rt.url.rsplit(":", 1)[1])
    cancelled_before = _sample(rt, "deepinfer_requests_finished_total", {"reason": "cancelled"})
    tokens_before = _sample(rt, "deepinfer_output_tokens_total")
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(_request(path, body, port))
        _wait_running(rt)
    finally:
        sock.close()  # the client goes away mid-reply
    sizes = rt.settle(timeout_s=120)  # every engine idle, every block balanced
    assert sizes["running"] == [0] and sizes["open_admissions"] == 0
    generated = _sample(rt, "deepinfer_output_tokens_total") - tokens_before
    print(f"\n{path} stream={stream}: {generated:.0f} of {MAX_TOKENS} tokens generated before the abort")
    assert generated < MAX_TOKENS // 2, f"the engine ran on after the client left ({generated:.0f} tokens)"
    assert _sample(rt, "deepinfer_requests_finished_total", {"reason": "cancelled"}) == cancelled_before + 1
