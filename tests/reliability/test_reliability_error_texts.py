"""A failure the client sees names a request id, never the internals (gloo peer
addresses, engine messages); the log keeps the details under that id.

Real pieces: ``Runtime`` with its HTTP server and the in-process rank group (reference engine,
'null' model: tokens without compute, never EOS, so a reply runs until ``max_tokens``). The group
failure is ``LocalRankGroup.restart`` with a reason that looks like a real one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rank.engine import FinishReason, RequestOutput
from tests.support.bodies import chat_body, path_of
from tests.support.runtime_thread import RuntimeThread
from tests.support.sse import SseParser, is_content_event, is_error_event

SECRET = "gloo: connection to peer 10.9.8.7:29513 reset; Traceback (most recent call last)"
ENGINE_SECRET = "KV pool exhausted during decode at block 4093 (rank 1, pid 31337)"


@pytest.fixture(scope="module")
def rt() -> Iterator[RuntimeThread]:
    config = {"engine": "reference", "reference_model": "null", "ep": 2, "block_size": 16,
              "reference_num_blocks": 2048, "max_model_len": 32768, "l1_cache": False, "port": 0}
    with RuntimeThread(config, rank_mode="local") as handle:
        yield handle


def _restart(rt: RuntimeThread) -> None:
    async def go() -> None:
        await rt.runtime.group.restart(SECRET)

    rt.call(go)


def _running(rt: RuntimeThread) -> int:
    async def read() -> int:
        group = rt.runtime.group
        return sum(group.stats(r).num_running for r in range(group.num_ranks))

    return rt.call(read)


def _no_internals(text: str) -> None:
    for fragment in ("10.9.8.7", "29513", "gloo", "Traceback", "pid 31337", "block 4093", "KV pool"):
        assert fragment not in text, f"{fragment!r} reached the client: {text}"


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_stream_cut_by_a_group_failure_names_the_request_id_only(
        rt: RuntimeThread, api: str, caplog: pytest.LogCaptureFixture) -> None:
    """Red before: the error frame said 'the engine restarted while serving this request: rank
    group epoch 1 failed: gloo: connection to peer 10.9.8.7:29513 reset; ...'."""
    body = chat_body(api, "tell me a long story", max_tokens=20000, stream=True)
    parser = SseParser()
    events = []
    with (caplog.at_level(logging.INFO), httpx.Client(base_url=rt.url, timeout=60) as client,
          client.stream("POST", path_of(api), json=body) as resp):
        assert resp.status_code == 200
        request_id = resp.headers["x-request-id"]
        restarted = False
        for chunk in resp.iter_bytes():
            events += parser.feed(chunk)
            if not restarted and any(is_content_event(api, ev) for ev in events):
                restarted = True
                _restart(rt)
    errors = [ev for ev in events if is_error_event(api, ev)]
    assert len(errors) == 1, events[-3:]
    text = str(errors[0].data)
    _no_internals(text)
    assert request_id in text and "retry" in text
    # the log has the details under the same id
    assert any(request_id in r.getMessage() and "10.9.8.7" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_non_streaming_request_cut_by_a_group_failure(rt: RuntimeThread, api: str) -> None:
    body = chat_body(api, "tell me a long story", max_tokens=30000, stream=False)
    result: dict[str, Any] = {}

    def send() -> None:
        with httpx.Client(base_url=rt.url, timeout=120) as client:
            result["resp"] = client.post(path_of(api), json=body)

    sender = threading.Thread(target=send)
    sender.start()
    for _ in range(2000):
        if _running(rt) or not sender.is_alive():
            break
        threading.Event().wait(0.01)
    assert sender.is_alive(), "the request finished before the failure: weak test"
    _restart(rt)
    sender.join(60)
    resp: httpx.Response = result["resp"]
    assert resp.status_code == 503
    _no_internals(resp.text)
    assert resp.headers["x-request-id"] in resp.text
    assert resp.headers.get("retry-after")


def test_engine_error_text_stays_in_the_log(rt: RuntimeThread, caplog: pytest.LogCaptureFixture) -> None:
    """An engine that ends a request with FinishReason.ERROR and a message naming its internals."""

    async def patch() -> None:
        for engine in rt.runtime.group.engines:
            step = engine.step

            def failing_step(step: Any = step, engine: Any = engine) -> list[RequestOutput]:
                outputs = []
                for out in step():
                    if out.finished:
                        continue  # the ABORT terminal of a request already failed below
                    engine.abort([out.request_id])
                    outputs.append(RequestOutput(out.request_id, [], True, FinishReason.ERROR,
                                                 out.num_prompt_tokens, out.num_cached_tokens, [],
                                                 ENGINE_SECRET))
                return outputs

            engine.step = failing_step

    async def unpatch() -> None:
        for engine in rt.runtime.group.engines:
            del engine.step

    rt.call(patch)
    try:
        with caplog.at_level(logging.INFO), httpx.Client(base_url=rt.url, timeout=60) as client:
            resp = client.post("/v1/messages", json=chat_body("anthropic", "hi", max_tokens=50, stream=False))
    finally:
        rt.call(unpatch)
    assert resp.status_code == 503
    _no_internals(resp.text)
    request_id = resp.headers["x-request-id"]
    assert request_id in resp.json()["error"]["message"]
    assert any(request_id in r.getMessage() and ENGINE_SECRET in r.getMessage() for r in caplog.records)
    rt.settle()


def test_client_errors_carry_the_request_id_header(rt: RuntimeThread) -> None:
    with httpx.Client(base_url=rt.url, timeout=60) as client:
        bad = client.post("/v1/chat/completions", json={"model": "default", "messages": []})
        count = client.post("/v1/messages/count_tokens",
                            json={"model": "default", "messages": [{"role": "user", "content": "hi"}]})
    assert bad.status_code == 400 and bad.headers.get("x-request-id")
    assert bad.headers["x-request-id"] not in bad.text  # a 4xx message stays as it was
    assert count.status_code == 200 and count.headers.get("x-request-id")
