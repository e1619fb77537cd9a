"""Server side: request bodies are parsed and tokenized off the event loop, in
two lanes, so a huge body neither stalls the loop nor queues in front of ordinary requests.

Ordering, not timing: the tests check what completed *while* something else was still running.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from bench.loop_stall_bench import dense_text
from protocol.errors import Overloaded
from server.prepare import RequestPreparer
from tests.support.runtime_thread import RuntimeThread


@pytest.fixture(scope="module")
def rt() -> Iterator[RuntimeThread]:
    config = {"engine": "reference", "reference_model": "null", "ep": 1, "block_size": 16,
              "reference_num_blocks": 256, "l1_cache": False, "port": 0}
    with RuntimeThread(config, rank_mode="local") as handle:
        yield handle


def test_healthz_answers_while_a_big_body_is_tokenized(rt: RuntimeThread) -> None:
    """Red before: the body was tokenized on the event loop, so /healthz waited for it."""
    tokenizer = rt.runtime.protocol.tokenizer
    started, finished = threading.Event(), threading.Event()
    encode = tokenizer.encode_segments

    def watched(*args: Any, **kwargs: Any) -> Any:
        started.set()
        try:
            return encode(*args, **kwargs)
        finally:
            finished.set()

    tokenizer.encode_segments = watched
    body = orjson.dumps({"model": "default",
                         "messages": [{"role": "user", "content": dense_text(7, 1_500_000)}]})
    result: dict[str, Any] = {}

    def send() -> None:
        with httpx.Client(base_url=rt.url, timeout=600) as client:
            result["count"] = client.post("/v1/messages/count_tokens", content=body,
                                          headers={"content-type": "application/json"})

    sender = threading.Thread(target=send)
    try:
        sender.start()
        assert started.wait(120), "the body never reached the tokenizer"
        with httpx.Client(base_url=rt.url, timeout=600) as client:
            health = client.get("/healthz")
        answered_during_tokenization = not finished.is_set()
        sender.join(600)
    finally:
        del tokenizer.encode_segments
    assert health.status_code == 200
    assert answered_during_tokenization, "/healthz was answered only after the tokenization ended"
    assert result["count"].status_code == 200 and result["count"].json()["input_tokens"] > 300_000


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_small_bodies_pass_a_busy_large_lane_and_large_ones_are_bounded() -> None:
    preparer = RequestPreparer(threads=1, large_body_bytes=1000, max_large_waiting=2)
    release = threading.Event()

    def slow(body: bytes) -> int:
        release.wait(60)
        return len(body)

    async def scenario() -> None:
        big = [asyncio.ensure_future(preparer.run(slow, b"x" * 5000)) for _ in range(2)]
        await asyncio.sleep(0)
        assert preparer.num_large_waiting == 2
        with pytest.raises(Overloaded) as err:  # a third large body while two are accepted
            await preparer.run(slow, b"y" * 5000)
        assert err.value.http_status == 503 and err.value.retry_after_s
        # the small lane is not behind the stuck large one
        assert await preparer.run(len, b"small") == 5
        release.set()
        assert await asyncio.gather(*big) == [5000, 5000]
        assert preparer.num_large_waiting == 0

    try:
        _run(scenario())
    finally:
        release.set()
        preparer.close()


def test_a_request_that_goes_away_keeps_its_large_slot_until_the_work_ends() -> None:
    preparer = RequestPreparer(threads=1, large_body_bytes=10, max_large_waiting=1)
    release, done = threading.Event(), threading.Event()

    def slow(body: bytes) -> None:
        release.wait(60)
        done.set()

    async def scenario() -> None:
        task = asyncio.ensure_future(preparer.run(slow, b"z" * 100))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert preparer.num_large_waiting == 1  # the thread still works on it
        with pytest.raises(Overloaded):
            await preparer.run(slow, b"w" * 100)
        release.set()
        while preparer.num_large_waiting:
            await asyncio.sleep(0.01)
        assert done.is_set()

    try:
        _run(scenario())
    finally:
        release.set()
        preparer.close()
