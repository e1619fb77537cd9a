"""The ``anthropic`` and ``openai`` SDK clients on top of the SDK runtime's ``POST /process``.

An httpx transport turns each request the client builds (``/v1/messages``,
``/v1/messages/count_tokens``, ``/v1/chat/completions``) into a job whose input is that very
body (``api`` named explicitly or left to recognition), and turns the job's answer back into
what the native route would have answered: ``output.response`` with status 200, or the
API-shaped error text of the SDK's ``{"error": ...}`` with the runtime's status. So the bodies
under test are the ones the real client libraries build, and the answers are parsed by their
own response types.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import httpx2  # the anthropic and openai client libraries' HTTP package
import openai

_APIS = {"/v1/messages": "anthropic", "/v1/messages/count_tokens": "anthropic",
         "/v1/chat/completions": "openai"}


class ProcessBridge(httpx2.BaseTransport):
    def __init__(self, process_url: str, *, name_api: bool = True, **envelope: Any) -> None:
        self.process_url = process_url
        self.name_api = name_api
        self.envelope = envelope  # extra job input keys (e.g. headers)
        self.jobs: list[dict[str, Any]] = []  # what went to /process
        self.outputs: list[dict[str, Any]] = []  # what came back (job outputs)
        self._client = httpx.Client(timeout=300)

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        body = json.loads(request.content)
        job_input = {**body, **self.envelope}
        if self.name_api:
            job_input["api"] = _APIS[path]
        if path.endswith("/count_tokens"):
            job_input["count_tokens"] = True
        job = {"id": f"bridge-{len(self.jobs)}", "input": job_input}
        self.jobs.append(job)
        resp = self._client.post(self.process_url, json=job)
        data = resp.json()
        if resp.status_code == 200:
            self.outputs.append(data["output"])
            return httpx2.Response(200, json=data["output"]["response"])
        try:
            error = json.loads(data["error"])  # the API-shaped error body, as JSON text
        except (ValueError, TypeError):
            error = data
        return httpx2.Response(resp.status_code, json=error)

    def close(self) -> None:
        self._client.close()


def anthropic_client(sdk_url: str, **bridge: Any) -> tuple[anthropic.Anthropic, ProcessBridge]:
    transport = ProcessBridge(sdk_url + "/process", **bridge)
    client = anthropic.Anthropic(base_url="http://process.invalid", api_key="unused", max_retries=0,
                                 http_client=httpx2.Client(transport=transport))
    return client, transport


def openai_client(sdk_url: str, **bridge: Any) -> tuple[openai.OpenAI, ProcessBridge]:
    transport = ProcessBridge(sdk_url + "/process", **bridge)
    client = openai.OpenAI(base_url="http://process.invalid/v1", api_key="unused", max_retries=0,
                           http_client=httpx2.Client(transport=transport))
    return client, transport
