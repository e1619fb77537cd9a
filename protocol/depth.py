"""Nesting-depth limit for everything a client sends as JSON: the body and JSON inside strings.

Rendering, the output ledger and the encoders walk client JSON recursively (``json.dumps`` of a
tool schema, ``repr``/``==`` of tool inputs, ``json.loads`` of argument strings, ``orjson.dumps``
with its own limit of 255), so depth ~1,000 ended in ``RecursionError`` -> 500. The boundary
refuses anything deeper than ``MAX_JSON_DEPTH`` with a 400 instead, checked without recursion:

* ``check_json_depth``: a parsed value (the request body, so tool schemas, ``tool_use.input``,
  ``response_format``, metadata: everything in it);
* ``check_json_text_depth``: JSON text inside a string (tool-call arguments), before it is parsed.

128 levels is far beyond real tool schemas (Claude Code's deepest is under 10) and well inside
every encoder's limit.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from protocol.errors import InvalidRequest

MAX_JSON_DEPTH = 128

_STRING_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')  # escapes included
_NOT_BRACKET_BYTES = bytes(b for b in range(256) if chr(b) not in "[]{}")
_BRACKET_STEP = np.zeros(256, dtype=np.int8)
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1


def check_json_depth(value: Any, where: str = "request", limit: int = MAX_JSON_DEPTH) -> None:
    """Raise a 400 naming the top-level field when ``value`` nests containers deeper than
    ``limit`` (``{}`` is depth 1)."""
    stack: list[tuple[Any, int, str]] = [(value, 1, where)]
    while stack:
        node, depth, field = stack.pop()
        if isinstance(node, dict):
            children: Any = node.items() if depth == 1 else ((field, v) for v in node.values())
        elif isinstance(node, list):
            children = ((field, v) for v in node)
        else:
            continue
        if depth > limit:
            raise InvalidRequest(f"{field}: JSON nested deeper than {limit} levels", param=field)
        for key, child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1, str(key) if depth == 1 else field))


def json_text_depth(text: str) -> int:
    """Bracket depth of JSON text, brackets inside string literals not counted (any text works;
    invalid JSON just gives some depth)."""
    if text.count("[") + text.count("{") == 0:
        return 0
    raw = _STRING_LITERAL.sub("", text).encode("utf-8", "surrogatepass")
    brackets = raw.translate(None, _NOT_BRACKET_BYTES)
    skeleton = np.frombuffer(brackets, dtype=np.uint8)
    return int(np.cumsum(_BRACKET_STEP[skeleton], dtype=np.int32).max(initial=0))


def check_json_text_depth(text: str, where: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise a 400 when JSON text (e.g. tool-call arguments) nests deeper than ``limit``."""
    if text.count("[") + text.count("{") > limit and json_text_depth(text) > limit:
        raise InvalidRequest(f"{where}: JSON nested deeper than {limit} levels", param=where)
