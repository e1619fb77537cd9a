"""``python -m deepinfer_backend smoke``: an operator's check of a running endpoint, one verdict line
per check, exit status 1 when any check fails.

    python -m deepinfer_backend smoke --url URL [--key KEY] [--api anthropic|openai|both]
        [--process] [--model NAME] [--timeout S]

Checks (per API in ``--api``; both by default):

* ``step5-tool-call``: the deployment guide's step-5 request (one user message "What is in
  README.md?" and a ``Read`` tool, max_tokens 300): the answer must call ``Read`` with a
  ``file_path``. A model with random weights (the reference engine) fails it; that is its point.
* ``stream``: the same request streamed; the event sequence must be whole (Anthropic:
  ``message_start`` ... ``message_stop``; OpenAI: one finish reason, a usage chunk, ``[DONE]``).
* ``two-turn-cache``: a ~2,000-token first turn (a fresh nonce, so an earlier run cannot serve
  it), then the same conversation one turn longer: the second turn must report at least half of
  the first turn's prompt as cached (Anthropic ``cache_read_input_tokens``, OpenAI
  ``prompt_tokens_details.cached_tokens``).
* ``count_tokens`` (Anthropic): ``/v1/messages/count_tokens`` of the step-5 body must equal the
  prompt size the step-5 answer reported (input + cache read + cache creation tokens).

Against the native routes by default (``URL/v1/...``: the platform's endpoint or a local
``serve``); with ``--process`` against the SDK's ``POST URL/process`` (``server/process_jobs.py``),
where ``stream`` is reported SKIP (``/process`` does not stream). The key goes out as
``x-api-key`` and ``Authorization: Bearer``. Only the standard library: it runs wherever the
checkout is, without the backend's venv.
"""

from __future__ import annotations

import argparse
import functools
import json
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

DEFAULT_MODEL = "deepseek-v4.1-flash"  # the deployment guide's model name
APIS = ("anthropic", "openai")
STEP5_PROMPT = "What is in README.md?"
READ_SCHEMA = {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}
ANTHROPIC_READ = {"name": "Read", "description": "Read a file", "input_schema": READ_SCHEMA}
OPENAI_READ = {"type": "function", "function": {"name": "Read", "description": "Read a file",
                                                 "parameters": READ_SCHEMA}}
CACHE_LINES = 80  # ~2,000 tokens: full KV blocks at any block size the backend takes


class CheckFailed(Exception):
    """A check's verdict: the endpoint answered, but not as it should."""


@dataclass(slots=True)
class Verdict:
    name: str
    outcome: str  # PASS, FAIL or SKIP
    seconds: float
    detail: str

    def line(self) -> str:
        return f"{self.outcome} {self.name} ({self.seconds:.1f} s): {self.detail}"


class Endpoint:
    """The native routes (``URL/v1/...``) or the SDK's ``URL/process``."""

    def __init__(self, url: str, key: str | None, process: bool, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.process = process
        self.timeout_s = timeout_s
        self.headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
        if key:
            self.headers |= {"x-api-key": key, "authorization": f"Bearer {key}"}

    def answer(self, api: str, body: dict[str, Any], *, count_tokens: bool = False) -> dict[str, Any]:
        """The API's own response body (through ``/process``: the job output's ``response``)."""
        if self.process:
            job_input = {**body, "api": api, **({"count_tokens": True} if count_tokens else {})}
            output = self._post("/process", {"id": f"smoke-{secrets.token_hex(4)}", "input": job_input})
            response = output.get("output", {}).get("response")
            if not isinstance(response, dict):
                raise CheckFailed(f"/process output has no response: {str(output)[:300]}")
            return response
        path = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}[api]
        return self._post(path + ("/count_tokens" if count_tokens else ""), body)

    def stream(self, api: str, body: dict[str, Any]) -> Iterator[tuple[str, str]]:
        """``(event, data)`` of each SSE frame (event is "" where the frame names none)."""
        path = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}[api]
        with self._open(path, {**body, "stream": True}) as resp:
            event = ""
            for raw in resp:
                line = raw.decode("utf-8").rstrip("\r\n")
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    yield event, line[5:].strip()
                    event = ""

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        with self._open(path, body) as resp:
            data = json.loads(resp.read())
        if not isinstance(data, dict):
            raise CheckFailed(f"{path} answered {str(data)[:200]}")
        return data

    def _open(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers=self.headers)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            text = exc.read()[:400].decode(errors="replace")
            raise CheckFailed(f"{path}: HTTP {exc.code}: {text}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise CheckFailed(f"{path}: {getattr(exc, 'reason', exc)}") from None


def step5_body(api: str, model: str) -> dict[str, Any]:
    tool = ANTHROPIC_READ if api == "anthropic" else OPENAI_READ
    return {"model": model, "max_tokens": 300, "messages": [{"role": "user", "content": STEP5_PROMPT}],
            "tools": [tool]}


def prompt_size(api: str, usage: dict[str, Any]) -> tuple[int, int]:
    """``(prompt tokens, cached tokens)`` from either API's usage."""
    if api == "anthropic":
        cached = int(usage.get("cache_read_input_tokens") or 0)
        created = int(usage.get("cache_creation_input_tokens") or 0)
        return int(usage["input_tokens"]) + cached + created, cached
    details = usage.get("prompt_tokens_details") or {}
    return int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0)


class Smoke:
    def __init__(self, endpoint: Endpoint, model: str) -> None:
        self.endpoint = endpoint
        self.model = model
        self.step5_prompt_tokens: int | None = None  # what count_tokens must match

    def step5_tool_call(self, api: str) -> str:
        body = self.endpoint.answer(api, step5_body(api, self.model))
        if api == "anthropic":
            self.step5_prompt_tokens = prompt_size(api, body["usage"])[0]
            calls = [(b.get("name"), b.get("input")) for b in body.get("content") or ()
                     if b.get("type") == "tool_use"]
            reason = body.get("stop_reason")
        else:
            choice = body["choices"][0]
            calls = [(c["function"]["name"], _json_or_text(c["function"]["arguments"]))
                     for c in choice["message"].get("tool_calls") or ()]
            reason = choice.get("finish_reason")
        read = [args for name, args in calls if name == "Read"]
        if not read or not isinstance(read[0], dict) or not isinstance(read[0].get("file_path"), str):
            raise CheckFailed(f"no Read tool call with a file_path (calls {calls}, stop {reason}); "
                              f"answer: {_excerpt(body)}")
        return f"Read {json.dumps(read[0])}, stop {reason}"

    def stream(self, api: str) -> str:
        body = step5_body(api, self.model)
        if api == "openai":
            body["stream_options"] = {"include_usage": True}
        frames = list(self.endpoint.stream(api, body))
        if api == "anthropic":
            events = [event for event, _ in frames]
            if not events or events[0] != "message_start" or events[-1] != "message_stop":
                raise CheckFailed(f"event sequence {events[:3]} ... {events[-3:]}")
            if "error" in events:
                raise CheckFailed(f"error event: {next(d for e, d in frames if e == 'error')[:300]}")
            delta = [json.loads(d) for e, d in frames if e == "message_delta"]
            if len(delta) != 1 or not delta[0]["usage"].get("output_tokens"):
                raise CheckFailed(f"message_delta {delta}")
            return f"{len(events)} events, stop {delta[0]['delta'].get('stop_reason')}"
        if not frames or frames[-1][1] != "[DONE]":
            raise CheckFailed(f"stream did not end with [DONE]: {frames[-2:]}")
        chunks = [json.loads(d) for _, d in frames[:-1]]
        errors = [c for c in chunks if "error" in c]
        finish = [c["choices"][0]["finish_reason"] for c in chunks
                  if c.get("choices") and c["choices"][0].get("finish_reason")]
        usage = [c["usage"] for c in chunks if c.get("usage")]
        if errors or len(finish) != 1 or not usage:
            raise CheckFailed(f"errors {errors[:1]}, finish reasons {finish}, usage chunks {len(usage)}")
        return f"{len(chunks)} chunks, finish {finish[0]}, {usage[-1].get('completion_tokens')} tokens"

    def two_turn_cache(self, api: str) -> str:
        nonce = secrets.token_hex(8)
        text = f"smoke {nonce}\n" + "\n".join(
            f"line {i}: the quick brown fox jumps over the lazy dog ({nonce})." for i in range(CACHE_LINES))
        first_messages: list[dict[str, Any]] = [{"role": "user", "content": text + "\nSummarise it."}]
        first = self.endpoint.answer(api, {"model": self.model, "max_tokens": 16, "messages": first_messages})
        prompt1, _ = prompt_size(api, first["usage"])
        if api == "anthropic":
            echo: dict[str, Any] = {"role": "assistant", "content": first["content"] or [
                {"type": "text", "text": "."}]}
        else:
            echo = {"role": "assistant", "content": first["choices"][0]["message"].get("content") or "."}
        second = self.endpoint.answer(api, {"model": self.model, "max_tokens": 16, "messages": [
            *first_messages, echo, {"role": "user", "content": "And the last line?"}]})
        prompt2, cached = prompt_size(api, second["usage"])
        if cached < max(1, prompt1 // 2):
            raise CheckFailed(f"second turn cached {cached} of {prompt2} prompt tokens "
                              f"(first turn {prompt1})")
        return f"second turn: {cached} of {prompt2} prompt tokens cached (first turn {prompt1})"

    def count_tokens(self) -> str:
        body = step5_body("anthropic", self.model)
        del body["max_tokens"]
        answer = self.endpoint.answer("anthropic", body, count_tokens=True)
        counted = answer.get("input_tokens")
        if not isinstance(counted, int) or counted <= 0:
            raise CheckFailed(f"count_tokens answered {answer}")
        if self.step5_prompt_tokens is not None and counted != self.step5_prompt_tokens:
            raise CheckFailed(f"count_tokens {counted} != the step-5 answer's prompt "
                              f"{self.step5_prompt_tokens}")
        same = "" if self.step5_prompt_tokens is None else ", the step-5 answer's prompt size"
        return f"{counted} input tokens{same}"


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _excerpt(body: dict[str, Any]) -> str:
    return json.dumps(body.get("content") or body.get("choices"))[:300]


def run_checks(smoke: Smoke, apis: tuple[str, ...], out: Callable[[str], None]) -> list[Verdict]:
    """Every check in order, each on its own: a failure is a verdict, never the end of the run."""
    verdicts: list[Verdict] = []

    def check(name: str, fn: Callable[[], str], skip: str | None = None) -> None:
        started = time.monotonic()
        if skip is not None:
            verdict = Verdict(name, "SKIP", 0.0, skip)
        else:
            try:
                verdict = Verdict(name, "PASS", 0.0, fn())
            except CheckFailed as exc:
                verdict = Verdict(name, "FAIL", 0.0, str(exc))
            except Exception as exc:  # noqa: BLE001 - an unexpected answer shape is a failed check
                verdict = Verdict(name, "FAIL", 0.0, f"{type(exc).__name__}: {exc}")
        verdict.seconds = time.monotonic() - started
        verdicts.append(verdict)
        out(verdict.line())

    for api in apis:
        check(f"step5-tool-call[{api}]", functools.partial(smoke.step5_tool_call, api))
    for api in apis:
        check(f"stream[{api}]", functools.partial(smoke.stream, api),
              skip="the SDK's /process does not stream" if smoke.endpoint.process else None)
    for api in apis:
        check(f"two-turn-cache[{api}]", functools.partial(smoke.two_turn_cache, api))
    check("count_tokens[anthropic]", smoke.count_tokens,
          skip=None if "anthropic" in apis else "count_tokens is an Anthropic route (--api openai)")
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer_backend smoke",
                                     description="Check a running endpoint; one verdict line per check.")
    parser.add_argument("--url", required=True, help="base URL: the workload endpoint or http://HOST:PORT")
    parser.add_argument("--key", help="API key (sent as x-api-key and Bearer)")
    parser.add_argument("--api", choices=["anthropic", "openai", "both"], default="both")
    parser.add_argument("--process", action="store_true", help="go through the SDK's POST URL/process")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model name (default {DEFAULT_MODEL})")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    args = parser.parse_args(argv)
    apis = APIS if args.api == "both" else (args.api,)
    endpoint = Endpoint(args.url, args.key, args.process, args.timeout)
    verdicts = run_checks(Smoke(endpoint, args.model), apis, lambda line: print(line, flush=True))
    failed = [v.name for v in verdicts if v.outcome == "FAIL"]
    passed = sum(v.outcome == "PASS" for v in verdicts)
    where = f"{endpoint.url}/process" if args.process else endpoint.url
    print(f"smoke: {passed} passed, {len(failed)} failed, {len(verdicts) - passed - len(failed)} skipped "
          f"against {where}" + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0
