"""The HTTP surface before the model is loaded: auth, limits, routes and error shapes."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from protocol.errors import AuthenticationError
from server.app import AppState, HealthReport, create_app
from server.auth import ApiKeyCheck
from server.config import load_config
from server.metrics import ServerMetrics
from tests.server.server_test_helpers import serve_asgi

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    config = load_config({"api_key": KEY, "max_body_bytes": 2048})
    state = AppState(config=config, metrics=ServerMetrics(),
                     health=lambda: HealthReport("loading", ["model loading"], ["preflight: disk slow"]))
    with serve_asgi(create_app(state)) as url:
        yield url


def test_head_root_is_200_without_auth(base_url: str) -> None:
    resp = httpx.head(base_url + "/")
    assert resp.status_code == 200


def test_healthz_loading_is_503_with_reasons(base_url: str) -> None:
    resp = httpx.get(base_url + "/healthz", headers={"x-api-key": KEY})
    assert resp.status_code == 503
    assert resp.json() == {"status": "loading", "reasons": ["model loading"],
                           "warnings": ["preflight: disk slow"]}


@pytest.mark.parametrize("headers", [{}, {"x-api-key": "wrong"}, {"authorization": "Basic abc"}])
def test_healthz_without_the_key_is_the_status_only(base_url: str, headers: dict[str, str]) -> None:
    """Red before: reasons and warnings (and, loaded, the ranks' pids and the
    last failure's text) went to anyone."""
    resp = httpx.get(base_url + "/healthz", headers=headers)
    assert resp.status_code == 503 and resp.json() == {"status": "loading"}


@pytest.mark.parametrize("path,shape", [("/v1/messages?beta=true", "anthropic"),
                                        ("/v1/chat/completions", "openai")])
def test_missing_key_is_401_in_route_shape(base_url: str, path: str, shape: str) -> None:
    resp = httpx.post(base_url + path, json={"model": "default"})
    assert resp.status_code == 401
    body = resp.json()
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    else:
        assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
    assert KEY not in resp.text


def test_two_different_keys_are_401(base_url: str) -> None:
    resp = httpx.post(base_url + "/v1/messages", json={},
                      headers={"x-api-key": KEY, "authorization": "Bearer other-key"})
    assert resp.status_code == 401
    assert "two different API keys" in resp.json()["error"]["message"]


def test_same_key_twice_passes_auth_then_503_while_loading(base_url: str) -> None:
    resp = httpx.post(base_url + "/v1/messages", json={"model": "default"},
                      headers={"x-api-key": KEY, "authorization": f"Bearer {KEY}"})
    assert resp.status_code == 503
    assert resp.json()["error"]["type"] == "overloaded_error"
    assert int(resp.headers["retry-after"]) >= 1


def test_body_over_limit_is_413_in_route_shape(base_url: str) -> None:
    big = {"model": "default", "messages": [{"role": "user", "content": "x" * 4096}]}
    resp = httpx.post(base_url + "/v1/messages", json=big, headers={"x-api-key": KEY})
    assert resp.status_code == 413
    assert resp.json()["error"]["type"] == "request_too_large"
    resp = httpx.post(base_url + "/v1/chat/completions", json=big, headers={"authorization": f"Bearer {KEY}"})
    assert resp.status_code == 413
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_unknown_route_and_method_in_route_shape(base_url: str) -> None:
    resp = httpx.post(base_url + "/v1/messages/batches", json={})
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
    resp = httpx.get(base_url + "/v1/messages")
    assert resp.status_code == 405 and resp.json()["type"] == "error"


def test_trailing_slash_is_404_without_reflecting_the_host(base_url: str) -> None:
    resp = httpx.post(base_url + "/v1/messages/", json={}, headers={"host": "evil.example"},
                      follow_redirects=False)
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
    assert "location" not in resp.headers and "evil.example" not in resp.text


def test_models_lists_served_names_in_both_shapes(base_url: str) -> None:
    resp = httpx.get(base_url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert {m["id"] for m in resp.json()["data"]} == {"deepseek-v4.1-flash", "deepinfer-v41-flash", "default"}
    resp = httpx.get(base_url + "/v1/models", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert resp.json()["data"][0]["type"] == "model"


def test_metrics_counts_requests_by_route_and_status(base_url: str) -> None:
    httpx.post(base_url + "/v1/chat/completions", json={})
    text = httpx.get(base_url + "/metrics").text
    assert 'deepinfer_requests_total{route="chat_completions",status="401"}' in text
    assert 'deepinfer_rank_group_state' not in text  # no runtime attached to this bare app


def test_api_key_check_unit() -> None:
    check = ApiKeyCheck("k1")
    check.check("k1", None)
    check.check(None, "Bearer k1")
    check.check("k1", "bearer k1")
    for x_key, auth in [("k2", None), (None, "Bearer k2"), (None, "Basic k1"), (None, None),
                        ("k1", "Bearer k2")]:
        with pytest.raises(AuthenticationError):
            check.check(x_key, auth)
    ApiKeyCheck(None).check(None, None)  # no key configured: open
