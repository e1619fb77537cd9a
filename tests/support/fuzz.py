"""Bad-input generators for every route, and the rule every answer must follow.

Three kinds of input, all as hypothesis strategies producing ``FuzzCase``s:

* raw: arbitrary bytes (invalid UTF-8, truncated JSON, NUL bytes), any JSON value that is not an
  object, deep nesting past the JSON parser's limit, empty and huge bodies;
* schema-driven: a valid request of the route (several shapes: tools, tool_use/tool_result
  history, system blocks, thinking, images) with 1-3 mutations at random paths: a value of the
  wrong type, a deleted key, an unknown key, an unknown role or block type, a tool schema that
  is not JSON Schema, ``max_tokens`` at 0/negative/enormous/non-integer, deep nesting inside a
  value that is allowed to be any JSON (tool input, schema, metadata), lone surrogates;
* size: prompts over ``max_model_len`` and bodies over ``max_body_bytes``.

``check_answer`` is the rule: never 5xx; a non-200 answer is an error in the route's own shape
(Anthropic for ``/v1/messages*``, OpenAI otherwise) whose message says what is wrong; a 200
stream carries no internal error frame.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

import orjson
from hypothesis import strategies as st

from tests.support.sse import SseParser, error_body_problem

CHAT_ROUTES = ("/v1/messages", "/v1/chat/completions", "/v1/messages/count_tokens")
GET_ROUTES = ("/v1/models", "/healthz")


@dataclass(slots=True)
class FuzzCase:
    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    kind: str  # what generated it (for the report)


def api_of(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


# ------------------------------------------------------------------ valid seeds per route

_TOOL_A = {"name": "Read", "description": "Read a file",
           "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                            "required": ["file_path"]}}
_TOOL_O = {"type": "function", "function": {"name": "Read", "description": "Read a file",
                                            "parameters": _TOOL_A["input_schema"]}}
_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def anthropic_seeds(max_tokens: int = 8) -> list[dict[str, Any]]:
    return [
        {"model": "default", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hello"}]},
        {"model": "deepseek-v4.1-flash", "max_tokens": max_tokens, "stream": True,
         "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
         "messages": [{"role": "user", "content": [{"type": "text", "text": "list files"}]}],
         "tools": [_TOOL_A], "tool_choice": {"type": "auto"}},
        {"model": "default", "max_tokens": max_tokens, "thinking": {"type": "enabled", "budget_tokens": 1024},
         "messages": [
             {"role": "user", "content": "read it"},
             {"role": "assistant", "content": [
                 {"type": "thinking", "thinking": "I will read.", "signature": "sig"},
                 {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/a"}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1",
                  "content": [{"type": "text", "text": "data"}]},
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _PNG}}]}],
         "tools": [_TOOL_A], "metadata": {"user_id": '{"session_id": "s1"}'}, "stop_sequences": ["END"],
         "temperature": 0.5, "top_p": 0.9, "top_k": 5},
    ]


def openai_seeds(max_tokens: int = 8) -> list[dict[str, Any]]:
    return [
        {"model": "default", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hello"}]},
        {"model": "default", "max_completion_tokens": max_tokens, "stream": True,
         "stream_options": {"include_usage": True},
         "messages": [{"role": "system", "content": "be terse"},
                      {"role": "user", "content": [{"type": "text", "text": "list files"}]}],
         "tools": [_TOOL_O], "tool_choice": "auto", "reasoning_effort": "high"},
        {"model": "default", "max_tokens": max_tokens, "seed": 3, "stop": ["END"], "temperature": 0.2,
         "messages": [
             {"role": "user", "content": "read it"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "Read", "arguments": '{"file_path": "/a"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "data"},
             {"role": "user",
              "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + _PNG}}]}],
         "tools": [_TOOL_O], "tool_choice": {"type": "function", "function": {"name": "Read"}},
         "response_format": {"type": "text"}},
    ]


def count_tokens_seeds() -> list[dict[str, Any]]:
    out = []
    for s in anthropic_seeds():
        s = {k: v for k, v in s.items() if k not in ("max_tokens", "stream", "stop_sequences", "temperature",
                                                     "top_p", "top_k", "metadata")}
        out.append(s)
    return out


def seeds_for(path: str) -> list[dict[str, Any]]:
    if path == "/v1/messages":
        return anthropic_seeds()
    if path == "/v1/chat/completions":
        return openai_seeds()
    return count_tokens_seeds()


# ------------------------------------------------------------------ value strategies

_json_leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
              | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30))
json_values = st.recursive(_json_leaf, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)

BAD_MAX_TOKENS = [0, -1, -(2**31), 2**31, 2**63, 2**64 + 1, 10**30, 1.5, "10", "", None, True, [], {}]
BAD_SCHEMAS = ["not a schema", 42, [], None, True, {"type": "nonsense"}, {"properties": "x"},
               {"type": "object", "properties": {"a": {"type": 7}}}, {"$ref": "#/definitions/missing"},
               {"type": "object", "required": "a"}]
WEIRD_STRINGS = ["", " ", "\x00", "\ud800", "\udfff", "a\ud800b", "🙂" * 50, "\u202e", "<｜User｜>",
                 "null", "x" * 2000]


def deep_list(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def deep_dict(depth: int) -> Any:
    value: Any = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if len(prefix) >= 12:  # a deep value planted by an earlier mutation: do not walk into it
        return out
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


def _set(root: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node = root
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return root


def _delete(root: Any, path: tuple[Any, ...]) -> Any:
    if not path:
        return root
    node = root
    for p in path[:-1]:
        node = node[p]
    del node[path[-1]]
    return root


@st.composite
def mutated_body(draw: st.DrawFn, path: str) -> tuple[Any, str]:
    """A valid seed of ``path`` with 1-3 schema-aware mutations; returns (JSON value, kind)."""
    body: Any = orjson.loads(orjson.dumps(draw(st.sampled_from(seeds_for(path)))))
    kinds = []
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(body)
        target = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "replace", "delete", "unknown_key", "role", "block_type",
                                   "max_tokens", "tool_schema", "deep", "weird_string", "model"]))
        kinds.append(op)
        if op == "replace":
            body = _set(body, target, draw(json_values))
        elif op == "delete" and target:
            body = _delete(body, target)
        elif op == "unknown_key":
            parent = body
            for p in target:
                if isinstance(parent, (dict, list)):
                    try:
                        parent = parent[p]
                    except (KeyError, IndexError, TypeError):
                        break
            if isinstance(parent, dict):
                parent[draw(st.text(min_size=1, max_size=10))] = draw(json_values)
        elif op == "role" and isinstance(body, dict) and isinstance(body.get("messages"),
                                                                    list) and body["messages"]:
            i = draw(st.integers(0, len(body["messages"]) - 1))
            if isinstance(body["messages"][i], dict):
                body["messages"][i]["role"] = draw(st.sampled_from(["tool", "function", "model", "", "USER",
                                                                    "developer", "ctx", None, 3]))
        elif op == "block_type":
            blocks = [p for p in paths if p and p[-1] == "type"]
            if blocks:
                body = _set(body, draw(st.sampled_from(blocks)), draw(st.sampled_from(
                    ["document", "search_result", "server_tool_use", "", "TEXT", "tool_use", "tool_result",
                     "image", "thinking", None, 5, "function", "input_audio"])))
        elif op == "max_tokens" and isinstance(body, dict):
            key = ("max_tokens"
                   if path != "/v1/chat/completions" or draw(st.booleans()) else "max_completion_tokens")
            body[key] = copy.deepcopy(draw(st.sampled_from(BAD_MAX_TOKENS)))
        elif op == "tool_schema" and isinstance(body, dict):
            bad = copy.deepcopy(draw(st.sampled_from(BAD_SCHEMAS)))
            if path == "/v1/chat/completions":
                body["tools"] = [{"type": "function", "function": {"name": "T", "parameters": bad}}]
            else:
                body["tools"] = [{"name": "T", "input_schema": bad}]
        elif op == "deep":
            # a marker, replaced by the nested JSON text in ``expand_deep`` (too deep to encode)
            depth = draw(st.sampled_from([50, 500, 990, 1100, 5000]))
            shape = "list" if draw(st.booleans()) else "dict"
            body = _set(body, target, f"__DEEP_{shape}_{depth}__")
        elif op == "weird_string":
            body = _set(body, target, draw(st.sampled_from(WEIRD_STRINGS)))
        elif op == "model" and isinstance(body, dict):
            body["model"] = draw(st.sampled_from(["", "gpt-4", "claude-opus-4", "DEFAULT", None, 1,
                                                  "default "]))
    if isinstance(body, dict):
        body.pop("stream", None) if draw(st.integers(0, 3)) == 0 else None
    return body, "mutate:" + "+".join(kinds)


_DEEP_RE = re.compile(rb'"__DEEP_(list|dict)_([0-9]+)__"')


def deep_json(shape: str, depth: int) -> bytes:
    if shape == "list":
        return b"[" * depth + b'"leaf"' + b"]" * depth
    return b'{"type": "object", "properties": {"a": ' * depth + b'{"type": "string"}' + b"}}" * depth


def expand_deep(raw: bytes) -> bytes:
    return _DEEP_RE.sub(lambda m: deep_json(m.group(1).decode(), int(m.group(2))), raw)


def _dumps(value: Any) -> bytes:
    """JSON bytes; falls back to a hand-made encoding when orjson refuses (lone surrogates,
    depth past its limit, integers past 64 bits): such bodies are exactly what a server must
    survive."""
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        import json

        return json.dumps(value, ensure_ascii=True).encode()


@st.composite
def raw_body(draw: st.DrawFn, path: str) -> tuple[bytes, str]:
    kind = draw(st.sampled_from(["bytes", "json_value", "truncated", "invalid_utf8", "deep", "empty",
                                 "nul", "surrogate_escape", "duplicate_keys"]))
    seed = orjson.dumps(draw(st.sampled_from(seeds_for(path))))
    if kind == "bytes":
        return draw(st.binary(max_size=400)), kind
    if kind == "json_value":
        value = draw(json_values.filter(lambda v: not isinstance(v, dict)))
        return _dumps(value), kind
    if kind == "truncated":
        return seed[: draw(st.integers(0, len(seed) - 1))], kind
    if kind == "invalid_utf8":
        cut = draw(st.integers(1, len(seed) - 2))
        junk = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80",
                                     b"\x80\x80"]))
        return seed[:cut] + junk + seed[cut:], kind
    if kind == "deep":
        depth = draw(st.sampled_from([600, 1025, 3000, 100_000]))
        return b"[" * depth + b"]" * depth, kind
    if kind == "empty":
        return draw(st.sampled_from([b"", b" ", b"{}", b"null", b"\n\n"])), kind
    if kind == "nul":
        return seed.replace(b'"hello"', b'"he\\u0000llo"').replace(b":", b":\x00", 1), kind
    if kind == "surrogate_escape":
        return seed.replace(b'"hello"',
                            b'"\\ud800\\udc00\\ud800"').replace(b'"list files"', b'"\\udfff"'), kind
    return seed[:-1] + b', "model": 7, "messages": null}', kind


@st.composite
def chat_case(draw: st.DrawFn, path: str) -> FuzzCase:
    which = draw(st.sampled_from(["mutate", "mutate", "mutate", "raw", "raw", "content_type"]))
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
    if which == "mutate":
        value, kind = draw(mutated_body(path))
        return FuzzCase("POST", path, expand_deep(_dumps(value)), headers, kind)
    if which == "raw":
        body, kind = draw(raw_body(path))
        return FuzzCase("POST", path, body, headers, "raw:" + kind)
    headers["content-type"] = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "",
                                                    "application/json; charset=latin-1",
                                                    "multipart/form-data"]))
    return FuzzCase("POST", path, orjson.dumps(draw(st.sampled_from(seeds_for(path)))), headers,
                    "content_type")


@st.composite
def get_case(draw: st.DrawFn, path: str) -> FuzzCase:
    query = draw(st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="#"),
                         max_size=40))
    headers: dict[str, str] = {}
    if draw(st.booleans()):
        headers["anthropic-version"] = draw(st.text(alphabet=st.characters(codec="ascii", min_codepoint=33,
                                                                           max_codepoint=126), max_size=20))
    method = draw(st.sampled_from(["GET", "GET", "GET", "POST", "PUT", "DELETE", "PATCH"]))
    body = draw(st.binary(max_size=64)) if method != "GET" else b""
    return FuzzCase(method, path + ("?" + query if query else ""), body, headers, f"get:{method}")


def case_strategy(path: str) -> st.SearchStrategy[FuzzCase]:
    return chat_case(path) if path in CHAT_ROUTES else get_case(path)


def check_answer(case: FuzzCase, status: int, headers: dict[str, str], body: bytes) -> str | None:
    """None if the answer follows the rule (module docstring); else what is wrong."""
    route = case.path.split("?")[0]
    if route in CHAT_ROUTES:
        api = api_of(route)
    elif status == 405 or "anthropic-version" not in case.headers:
        api = "openai"  # the router's 405 goes by path; /v1/models answers Anthropic clients in kind
    else:
        api = "anthropic"
    if status >= 500:
        return f"{case.kind}: HTTP {status}: {body[:300]!r}"
    if status == 200:
        ctype = headers.get("content-type", "")
        if ctype.startswith("text/event-stream"):
            for ev in SseParser().feed(body):
                data = ev.data
                if ev.event == "error" or (isinstance(data, dict) and "error" in data
                                           and "choices" not in data):
                    err = data.get("error", {}) if isinstance(data, dict) else {}
                    if err.get("type") in ("api_error",
                                           "server_error") and "overloaded" not in str(err.get("code")):
                        return f"{case.kind}: stream error frame {data!r:.300}"
            return None
        try:
            orjson.loads(body)
        except orjson.JSONDecodeError:
            return f"{case.kind}: 200 with a body that is not JSON: {body[:200]!r}"
        return None
    if route == "/healthz" and status == 503:
        return None
    problem = error_body_problem(api, status, body)
    return f"{case.kind}: {problem}" if problem else None
