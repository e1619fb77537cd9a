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
    ``limit`` (``{}`` is depth 1).

    One walk without recursion; the hot loop touches each child once (a type test) and stacks
    containers only, so a 2 MB agent body costs about a millisecond."""
    if isinstance(value, dict) and limit >= 1:
        for key, child in value.items():
            if isinstance(child, (dict, list)) and _deeper_than(child, limit - 1):
                field = str(key)
                raise InvalidRequest(f"{field}: JSON nested deeper than {limit} levels", param=field)
    elif _deeper_than(value, limit):
        raise InvalidRequest(f"{where}: JSON nested deeper than {limit} levels", param=where)


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests containers more than ``limit`` levels (a scalar is depth 0)."""
    if not isinstance(value, (dict, list)):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if depth > limit:
            return True
        for child in (node.values() if isinstance(node, dict) else node):
            if isinstance(child, (dict, list)):
                push((child, depth + 1))
    return False


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
