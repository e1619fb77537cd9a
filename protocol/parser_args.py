"""Tool-call arguments streamed while a DSML invoke is still being generated.

A call's arguments JSON is built value by value (``args_json``): ``{`` + ``"key":value`` pairs
joined by ``,`` + ``}``, each part in orjson's compact form, so a *prefix* of the final text can
be sent before the invoke closes:

* a string parameter (``string="true"``) streams its characters inside the JSON string as they
  arrive (JSON escaping is per character, so chunk-wise escaping joins to the whole);
* any other value (``string="false"`` or no ``string``: JSON, or a string when invalid) goes out
  whole when its parameter closes, since its type is known only then;
* held back: a possible tag start (``<｜DSML｜ para``...), trailing newlines of a string value
  (a value ended by the next parameter instead of its close loses them, rule 7 of parser.py),
  and a lone undeclared ``arguments``/``input`` object that wrapper collapse (rule 8) may still
  unwrap; a duplicate parameter (first wins) is never sent.

When the invoke closes, parser.py parses it whole (the authority) and ``ArgStreamer.close``
returns the rest of that JSON. Invariant: what was streamed is a prefix of the final JSON, so
the joined argument deltas equal the non-streaming ``arguments`` exactly; anything this module
is unsure of (an attribute that may still change) is simply not streamed until the close.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from protocol.detokenize import S_DSML, SENTINEL_TEXT

_D = S_DSML
_PARAM_OPEN_RE = re.compile("<" + _D + " ?parameter")
_PARAM_ATTR_RE = re.compile(r'\s*name="([^"]*)"(?:\s+string="([^"]*)")?[^>]*>')
_PARAM_CLOSE_RE = re.compile("</" + _D + " ?parameter>")
# every tag that can end a parameter value; a partial one at the end of the text is held back
_TAGS = tuple(
    t.replace("D", _D)
    for t in ("</D parameter>", "</Dparameter>", "<D parameter", "<Dparameter", "</D invoke>", "</Dinvoke>")
)
_MAX_TAG = max(len(t) for t in _TAGS)
_SENTINEL_RE = re.compile(f"[{''.join(SENTINEL_TEXT)}]")
_WRAPPER_KEYS = ("arguments", "input")


def dumps_value(value: Any) -> str:
    """One JSON value, compact (orjson; the stdlib for integers beyond 64 bits)."""
    try:
        return orjson.dumps(value).decode("utf-8")
    except TypeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def args_json(args: dict[str, Any]) -> str:
    """The arguments JSON of a call, built the way ``ArgStreamer`` streams it."""
    return "{" + ",".join(dumps_value(k) + ":" + dumps_value(v) for k, v in args.items()) + "}"


def restore_text(text: str) -> str:
    """Sentinels back to their literal text (for text that turned out not to be a tag)."""
    if _SENTINEL_RE.search(text) is None:
        return text
    return _SENTINEL_RE.sub(lambda m: SENTINEL_TEXT[m.group(0)], text)


def clean_value(raw: str) -> str:
    """Raw parameter text -> value text: stray DSML sentinels dropped, other sentinels restored."""
    if _SENTINEL_RE.search(raw) is None:
        return raw
    return restore_text(raw.replace(_D, ""))


def param_value(raw: str, string_attr: str | None) -> Any:
    """``string="true"``: the raw text; otherwise JSON if it parses (finite), else the text."""
    if string_attr == "true":
        return raw
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:  # invalid, NaN/Infinity, or out of double range (1e999)
        return raw


def _escape(text: str) -> str:
    return dumps_value(text)[1:-1]


def _held_tag_start(body: str, start: int) -> int:
    """Index of a partial tag at the end of ``body`` (at or after ``start``), else len(body)."""
    n = len(body)
    for k in range(max(start, n - _MAX_TAG), n):
        if body[k] == "<":
            tail = body[k:]
            if any(t.startswith(tail) for t in _TAGS):
                return k
    return n


class ArgStreamer:
    """Streams one invoke's arguments. ``advance(body)`` with the invoke body so far (after its
    name tag) returns the new JSON text; ``close(final_json)`` returns the rest."""

    __slots__ = ("_declared", "_pos", "_keys", "_sent", "_num_pairs", "_cur", "_held")

    def __init__(self, declared: frozenset[str] | None) -> None:
        self._declared = declared or frozenset()
        self._pos = 0  # where the next parameter tag is searched
        self._keys: set[str] = set()
        self._sent: list[str] = []
        self._num_pairs = 0
        # the open value: [key, string_attr, value start, sent up to, searched up to, skip]
        self._cur: list[Any] | None = None
        self._held: tuple[str, Any] | None = None  # a wrapper candidate (rule 8)

    @property
    def sent(self) -> str:
        return "".join(self._sent)

    def advance(self, body: str) -> str:
        out: list[str] = []
        while True:
            if self._cur is not None:
                if not self._advance_value(body, out):
                    break
                continue
            po = _PARAM_OPEN_RE.search(body, self._pos)
            if po is None:
                break
            am = _PARAM_ATTR_RE.match(body, po.end())
            if am is None or (am.group(2) is None and "string=" in am.group(0)):
                break  # attributes incomplete, or a string attribute that may still complete
            key = restore_text(am.group(1))
            skip = key in self._keys
            if not skip:
                self._keys.add(key)
                self._release_held(out)
                if am.group(2) == "true":
                    out.append(self._pair_head(key) + '"')
            self._cur = [key, am.group(2), am.end(), am.end(), am.end(), skip]
        text = "".join(out)
        if text:
            self._sent.append(text)
        return text

    def close(self, final_json: str) -> tuple[str, bool]:
        """The rest of ``final_json`` and whether the streamed text was its prefix (the
        invariant; parser.py counts a violation rather than failing the request)."""
        sent = self.sent
        if final_json.startswith(sent):
            return final_json[len(sent) :], True
        return "", False

    # --- internals ---------------------------------------------------------------------------------
    def _pair_head(self, key: str) -> str:
        head = ("{" if self._num_pairs == 0 else ",") + dumps_value(key) + ":"
        self._num_pairs += 1
        return head

    def _release_held(self, out: list[str]) -> None:
        if self._held is not None:
            key, value = self._held
            self._held = None
            out.append(self._pair_head(key) + dumps_value(value))

    def _advance_value(self, body: str, out: list[str]) -> bool:
        """Stream the open value; True when it ended (the parameter scan continues)."""
        cur = self._cur
        assert cur is not None
        key, string_attr, vstart, sent_to, searched_to, skip = cur
        from_ = max(vstart, searched_to - _MAX_TAG)
        pc = _PARAM_CLOSE_RE.search(body, from_)
        nxt = _PARAM_OPEN_RE.search(body, from_)
        if pc is not None and (nxt is None or pc.start() < nxt.start()):
            end, next_pos = pc.start(), pc.end()
        elif nxt is not None:  # a missing close before the next parameter: trailing newlines go
            end = vstart + len(body[vstart : nxt.start()].rstrip("\n"))
            next_pos = nxt.start()
        else:
            cur[4] = len(body)
            if string_attr == "true" and not skip:
                safe = _held_tag_start(body, sent_to)
                while safe > sent_to and body[safe - 1] == "\n":
                    safe -= 1
                if safe > sent_to:
                    out.append(_escape(clean_value(body[sent_to:safe])))
                    cur[3] = safe
            return False
        self._cur = None
        self._pos = next_pos
        if skip:
            return True
        if string_attr == "true":
            out.append(_escape(clean_value(body[sent_to:end])) + '"')
            return True
        value = param_value(clean_value(body[vstart:end]), string_attr)
        if (
            self._num_pairs == 0
            and key in _WRAPPER_KEYS
            and self._declared
            and key not in self._declared
            and isinstance(value, dict)
            and set(value) <= self._declared
        ):
            self._held = (key, value)  # collapses if it stays alone; decided at the close
        else:
            out.append(self._pair_head(key) + dumps_value(value))
        return True
