"""The backend against both SDK generations: 0.260725.739 (no streaming, no ``api=``) and a newer
one whose ``package_backend`` takes ``api=`` and which hands ``chat()`` request objects."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from inferencekey.backend import InvalidInput, Job, package_backend
from pydantic import BaseModel

import publish
from deepinfer_backend import DeepInferBackend, _request_to_body, job_to_openai_body


def test_published_sdk_has_no_api_keyword_and_publish_still_packages(tmp_path: Path) -> None:
    assert "api" not in inspect.signature(package_backend).parameters  # 0.260725.739
    pkg, names = publish.build_package("0.0.1", "t", str(tmp_path), "3.12")
    assert "deepinfer_backend.py" in names and pkg.manifest["entrypoint"] == publish.ENTRYPOINT


def test_newer_sdk_gets_api_keyword(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def newer_package_backend(*, api: str | None = None, **kwargs: Any) -> Any:
        seen["api"] = api
        return package_backend(**kwargs)

    monkeypatch.setattr("inferencekey.backend.package_backend", newer_package_backend)
    publish.build_package("0.0.2", "t", str(tmp_path), "3.12")
    assert seen["api"] == "openai-chat"


def test_job_shapes_map_to_openai_body() -> None:
    body = job_to_openai_body(Job(id="1", input={"prompt": "hi", "max_tokens": 7, "envelope": 1}))
    assert body == {"model": "default", "messages": [{"role": "user", "content": "hi"}],
                    "stream": False, "max_tokens": 7}
    msgs = [{"role": "user", "content": "x"}]
    assert job_to_openai_body(Job(id="2", input={"messages": msgs, "model": "m"}))["model"] == "m"
    for bad in ({}, {"prompt": ""}, {"messages": []}, {"messages": "text"}):
        with pytest.raises(InvalidInput):
            job_to_openai_body(Job(id="3", input=bad))


def test_chat_accepts_what_a_streaming_sdk_may_pass() -> None:
    class ChatRequest(BaseModel):
        model: str = "default"
        messages: list[dict[str, Any]]
        max_tokens: int | None = None

    @dataclass
    class WireRequest:
        payload: dict[str, Any] = field(default_factory=dict)

        def to_wire(self) -> dict[str, Any]:
            return self.payload

    msgs = [{"role": "user", "content": "x"}]
    assert _request_to_body(ChatRequest(messages=msgs))["messages"] == msgs
    assert "max_tokens" not in _request_to_body(ChatRequest(messages=msgs))
    assert _request_to_body(WireRequest({"messages": msgs}))["messages"] == msgs
    assert _request_to_body(Job(id="j", input={"prompt": "p"}))["messages"][0]["content"] == "p"
    assert _request_to_body({"input": {"prompt": "p"}})["messages"][0]["content"] == "p"
    with pytest.raises(InvalidInput):
        _request_to_body(42)
    # extra positional/keyword arguments (a context, options) do not break the call shape
    params = inspect.signature(DeepInferBackend.chat).parameters
    assert any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values())
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
