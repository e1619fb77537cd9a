"""Bad input on every route, property-based and schema-driven.

300 generated requests per route in the default suite, the full 5,000 per route under
``-m slow`` (the ``[full-...]`` cases; RELIABILITY_FUZZ_EXAMPLES overrides both), driven
in-process through the ASGI app (``httpx.ASGITransport``) of a real ``Runtime`` whose ranks are
in-process (``LocalRankGroup``) and run the scripted stand-in model, so a request that happens to
be valid is really served. A smaller run goes over real HTTP (100 per route; 300 under
``-m slow``). The rule (``check_answer``): never a 5xx, never a hang (30 s per request), every
error in the route's own shape with a message that says what is wrong; request bodies over
``max_body_bytes`` get 413.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings

from tests.support.fuzz import CHAT_ROUTES, GET_ROUTES, FuzzCase, case_strategy, check_answer, deep_dict
from tests.support.runtime_thread import RuntimeThread

_OVERRIDE = os.environ.get("RELIABILITY_FUZZ_EXAMPLES")
NUM_EXAMPLES = int(_OVERRIDE or 300)  # the default suite: a few hundred per route
NUM_EXAMPLES_FULL = int(_OVERRIDE or 5000)  # -m slow: the full volume
_HTTP_OVERRIDE = os.environ.get("RELIABILITY_FUZZ_HTTP_EXAMPLES")
NUM_HTTP_EXAMPLES = int(_HTTP_OVERRIDE or 100)
NUM_HTTP_EXAMPLES_FULL = int(_HTTP_OVERRIDE or 300)
MAX_MODEL_LEN = 2048
MAX_BODY_BYTES = 64 * 1024
SCRIPT = {"description": "fuzz", "tokens_per_step": 8, "replies": [{"name": "any", "text": "ok."}]}


class Driver:
    """Sends cases to the app on the runtime's loop and records every broken rule."""

    def __init__(self, rt: RuntimeThread) -> None:
        self.rt = rt
        self.count: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.failures: list[str] = []

        async def make() -> httpx.AsyncClient:
            return httpx.AsyncClient(transport=httpx.ASGITransport(app=rt.runtime.app),
                                     base_url="http://fuzz")

        self.client = rt.call(make)

    def send(self, case: FuzzCase) -> None:
        async def go() -> tuple[int, dict[str, str], bytes]:
            resp = await asyncio.wait_for(
                self.client.request(case.method, case.path, content=case.body, headers=case.headers), 30)
            return resp.status_code, dict(resp.headers), resp.content

        try:
            status, headers, body = self.rt.call(go, 60)
        except (asyncio.TimeoutError, TimeoutError):
            self.failures.append(f"{case.kind}: hang on {case.path}")
            return
        route = case.path.split("?")[0]
        self.count[route] += 1
        self.statuses[f"{route} {status}"] += 1
        problem = check_answer(case, status, headers, body)
        if problem:
            self.failures.append(f"{case.path}: {problem} (body {case.body[:200]!r})")


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeThread]:
    script = tmp_path_factory.mktemp("fuzz") / "script.json"
    script.write_text(json.dumps(SCRIPT))
    config = {"engine": "scripted", "script_file": str(script), "ep": 2, "block_size": 16,
              "reference_num_blocks": 1024, "max_model_len": MAX_MODEL_LEN, "l1_cache": False, "port": 0,
              "max_body_bytes": MAX_BODY_BYTES, "request_timeout_secs": 30}
    with RuntimeThread(config, rank_mode="local") as handle:
        yield handle


@pytest.fixture(scope="module")
def driver(rt: RuntimeThread) -> Iterator[Driver]:
    d = Driver(rt)
    yield d
    rt.call(d.client.aclose)


def _fuzz(driver: Driver, route: str, num_examples: int) -> None:
    @settings(max_examples=num_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=case_strategy(route))
    def run(case: FuzzCase) -> None:
        driver.send(case)

    before = driver.count[route]
    driver.failures.clear()
    run()
    n = driver.count[route] - before
    statuses = {k.split(" ", 1)[1]: v for k, v in driver.statuses.items() if k.startswith(route + " ")}
    print(f"\n{route}: {n} requests, statuses {dict(sorted(statuses.items()))}, broken rules "
          f"{len(driver.failures)}")
    assert not driver.failures, "\n".join(driver.failures[:15])
    assert n >= num_examples


def volumes(default: int, full: int) -> pytest.MarkDecorator:
    """``num_examples``: ``default`` in the default suite, ``full`` under ``-m slow``."""
    return pytest.mark.parametrize("num_examples", [
        pytest.param(default, id="default"),
        pytest.param(full, id="full", marks=[pytest.mark.slow, pytest.mark.timeout(1800)]),
    ])


@volumes(NUM_EXAMPLES, NUM_EXAMPLES_FULL)
@pytest.mark.parametrize("route", CHAT_ROUTES + GET_ROUTES)
def test_fuzz_route_in_process(driver: Driver, route: str, num_examples: int) -> None:
    _fuzz(driver, route, num_examples)


# ------------------------------------------------------------------ targeted, named cases

def _post(driver: Driver, path: str, body: Any, **headers: str) -> tuple[int, dict[str, Any]]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    case = FuzzCase("POST", path, raw, {"content-type": "application/json", **headers}, "named")

    async def go() -> httpx.Response:
        return await driver.client.request("POST", path, content=raw, headers=case.headers)

    resp = driver.rt.call(go)
    problem = check_answer(case, resp.status_code, dict(resp.headers), resp.content)
    assert problem is None, problem
    return resp.status_code, resp.json()


@pytest.mark.parametrize("path", CHAT_ROUTES)
def test_named_bad_inputs_get_clear_messages(driver: Driver, path: str) -> None:
    anthropic = path.startswith("/v1/messages")

    def msg(body: dict[str, Any]) -> str:
        return body["error"]["message"]

    base: dict[str, Any] = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
    if path != "/v1/messages/count_tokens":
        base["max_tokens"] = 8
    status, body = _post(driver, path, b"{not json")
    assert status == 400 and "JSON" in msg(body)
    status, body = _post(driver, path, b"[1, 2]")
    assert status == 400 and "object" in msg(body)
    status, body = _post(driver, path, {**base, "messages": [{"role": "wizard", "content": "hi"}]})
    assert status == 400 and "role" in msg(body)
    status, body = _post(driver, path, {**base, "messages": "hi"})
    assert status == 400 and "messages" in msg(body)
    huge = {**base, "messages": [{"role": "user", "content": "word " * (MAX_MODEL_LEN * 2)}]}
    if len(orjson.dumps(huge)) < MAX_BODY_BYTES:
        status, body = _post(driver, path, huge)
        if path == "/v1/messages/count_tokens" and status == 200:  # counting an over-long prompt is fine
            assert body["input_tokens"] > MAX_MODEL_LEN
        else:
            assert status == 400 and msg(body).startswith("prompt is too long: ")
    status, body = _post(driver, path,
                         {**base, "messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]})
    assert status == 413 and str(MAX_BODY_BYTES) in msg(body)
    if path != "/v1/messages/count_tokens":
        status, body = _post(driver, path, {**base, "max_tokens": 0})
        assert status == 400 and "max_tokens" in msg(body)
        status, body = _post(driver, path, {**base, "max_tokens": 10**30})
        assert status in (200, 400)
        if status == 400:
            assert "max_tokens" in msg(body)
    tools = ([{"name": "T", "input_schema": "not a schema"}] if anthropic
             else [{"type": "function", "function": {"name": "T", "parameters": "not a schema"}}])
    status, body = _post(driver, path, {**base, "tools": tools})
    assert status == 400 and ("schema" in msg(body) or "tools" in msg(body))
    deep = {**base, "tools": [{"name": "T", "input_schema": deep_dict(400)}] if anthropic else
            [{"type": "function", "function": {"name": "T", "parameters": deep_dict(400)}}]}
    status, body = _post(driver, path, deep)
    assert status in (200, 400)


def test_body_limit_applies_to_chunked_bodies_without_length(rt: RuntimeThread) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 2):
            yield b"y" * 1024
        yield b'"}]}'

    for path, err_type in (("/v1/messages", "request_too_large"),
                           ("/v1/chat/completions", "invalid_request_error")):
        resp = httpx.post(rt.url + path, content=chunks(), headers={"content-type": "application/json"},
                          timeout=30)
        assert resp.status_code == 413
        assert resp.json()["error"]["type"] == err_type


# ------------------------------------------------------------------ the same over real HTTP

@volumes(NUM_HTTP_EXAMPLES, NUM_HTTP_EXAMPLES_FULL)
def test_fuzz_every_route_over_real_http(rt: RuntimeThread, num_examples: int) -> None:
    failures: list[str] = []
    counts: Counter[str] = Counter()
    client = httpx.Client(base_url=rt.url, timeout=30)

    def fuzz(route: str) -> None:
        @settings(max_examples=num_examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=case_strategy(route))
        def run(case: FuzzCase) -> None:
            try:
                resp = client.request(case.method, case.path, content=case.body, headers=case.headers)
            except httpx.HTTPError as exc:
                failures.append(f"{case.kind}: {type(exc).__name__} on {case.path}")
                return
            counts[route] += 1
            problem = check_answer(case, resp.status_code, dict(resp.headers), resp.content)
            if problem:
                failures.append(f"{case.path}: {problem}")

        run()

    for route in CHAT_ROUTES + GET_ROUTES:
        fuzz(route)
    client.close()
    print(f"\nreal HTTP: {dict(counts)}")
    assert not failures, "\n".join(failures[:15])
    assert all(counts[r] >= num_examples // 2 for r in CHAT_ROUTES + GET_ROUTES), counts
