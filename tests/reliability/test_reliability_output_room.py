"""Over HTTP: a reply up to max_tokens completes next to idle cached prefixes,
and a max_tokens that cannot fit is refused before the first token in a way clients act on.

Before: with the pool mostly holding an idle session's blocks, a reply past the 8,192 tokens
reserved at admission ended with "KV pool exhausted during decode" (reference engine) or a 503 "no
KV capacity" before its first token (scripted engine), and Claude Code retries a 503 for minutes.
Now the reservation grows while the reply decodes (cache/output_room.py), and a max_tokens no pool
can hold gets the Anthropic API's 400 ``input length and `max_tokens` exceed context limit``,
which Claude Code answers with one retry at a smaller max_tokens (simulated here with its regex).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.runtime_thread import RuntimeThread

pytestmark = pytest.mark.timeout(600)
BLOCKS = 1024  # x 16 tokens: 16,336 usable tokens per rank (2 blocks of slack)
IDLE_WORDS = 5000  # an idle session holding most of the pool
LONG = 12_000  # > the 8,192 output tokens an admission reserves
CLAUDE_CODE_RE = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)")


def _config(engine: str, tmp: Path) -> dict[str, object]:
    config: dict[str, object] = {"engine": engine, "ep": 1, "block_size": 16, "reference_num_blocks": BLOCKS,
                                 "max_model_len": 65_536, "l1_cache": False, "port": 0,
                                 "request_timeout_secs": 300}
    if engine == "reference":
        config["reference_model"] = "null"
    else:
        script = tmp / "script.json"
        script.write_text(json.dumps({"tokens_per_step": 64, "replies": [{"text": "long", "eos": False}]}))
        config["script_file"] = str(script)
    return config


@pytest.fixture(scope="module", params=["reference", "scripted"])
def rt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeThread]:
    with RuntimeThread(_config(request.param, tmp_path_factory.mktemp("room")), rank_mode="local") as handle:
        yield handle


def _anthropic(rt: RuntimeThread, text: str, max_tokens: int, stream: bool = False) -> httpx.Response:
    body = {"model": "default", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": text}]}
    return httpx.post(rt.url + "/v1/messages", json=body, timeout=300)


def _fill_with_idle_session(rt: RuntimeThread) -> int:
    resp = _anthropic(rt, " ".join(f"w{i}" for i in range(IDLE_WORDS)), 4)
    assert resp.status_code == 200, resp.text
    rt.settle()
    cached = sum(rt.cache_sizes()["l0_blocks"])
    assert cached * 16 > 10_000, f"the idle session holds only {cached} blocks"
    return cached


def test_a_long_reply_completes_next_to_an_idle_session(rt: RuntimeThread) -> None:
    cached = _fill_with_idle_session(rt)
    resp = _anthropic(rt, "write a long essay", LONG, stream=True)
    assert resp.status_code == 200
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert not any('"type":"error"' in e for e in events), [e for e in events if "error" in e][:1]
    delta = json.loads(next(e for e in events if '"message_delta"' in e))
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == LONG
    sizes = rt.settle()
    assert sum(sizes["l0_blocks"]) < cached + LONG // 16  # idle blocks were evicted to make room
    grown = rt.runtime.metrics.registry.get_sample_value("deepinfer_cache_output_room_grown_blocks_total")
    print(f"\n{LONG}-token reply next to an idle session of {cached} blocks: completed; the reservation "
          f"grew by {grown:.0f} blocks while decoding; L0 after: {sum(sizes['l0_blocks'])} blocks")


def test_a_max_tokens_no_pool_can_hold_is_a_400_claude_code_shrinks(rt: RuntimeThread) -> None:
    _fill_with_idle_session(rt)
    room = (BLOCKS - 1 - 2) * 16
    resp = _anthropic(rt, "another essay", room, stream=True)
    assert resp.status_code == 400 and resp.headers["x-should-retry"] == "false"
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    found = CLAUDE_CODE_RE.search(error["message"])
    assert found is not None, error["message"]
    input_tokens, max_tokens, limit = map(int, found.groups())
    print(f"\n400: {error['message']}")
    assert max_tokens == room and limit == room
    # Claude Code retries once with max_tokens = limit - input - 1000 (and only if >= 3000)
    retry = _anthropic(rt, "another essay", limit - input_tokens - 1000)
    assert retry.status_code == 200, retry.text
    assert retry.json()["usage"]["output_tokens"] == limit - input_tokens - 1000
    # an OpenAI request without max_tokens (a default: the rest of max_model_len) is trimmed
    resp = httpx.post(rt.url + "/v1/chat/completions", timeout=300, json={
        "model": "default", "messages": [{"role": "user", "content": "and one more"}]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == room
    rt.settle()


def test_concurrent_long_replies_that_were_admitted_all_finish(tmp_path: Path) -> None:
    """Three replies of 14,000 tokens on a pool of 32K tokens: each was admitted with 8,192
    tokens reserved, and together they outgrew the pool while decoding, so some ended mid-stream
    with ``overloaded_error`` (nothing idle left to evict: running sequences held the pool). Now
    admission counts each turn's worst case (prompt + max_tokens): the third waits until one ends,
    and every admitted reply finishes."""
    config = _config("scripted", tmp_path) | {"reference_num_blocks": 2048}
    num_streams, long = 3, 14_000
    with RuntimeThread(config, rank_mode="local") as handle:
        def one(i: int) -> tuple[int, str]:
            resp = _anthropic(handle, f"long essay number {i}", long, stream=True)
            return resp.status_code, resp.text

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(num_streams) as pool:
            results = list(pool.map(one, range(num_streams)))
        for status, text in results:
            assert status == 200, text[:300]
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert not any('"type":"error"' in e for e in events), [e for e in events if "error" in e][:1]
            delta = json.loads(next(e for e in events if '"message_delta"' in e))
            assert delta["usage"]["output_tokens"] == long
        handle.settle()
