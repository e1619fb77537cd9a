"""``ToolsTextCache``: the memoized tool-schema text is the uncached text, and the cache is a
bounded LRU (each ``Protocol`` owns one; it replaced a module-level dict emptied at 256)."""

from __future__ import annotations

from typing import Any

from protocol.render import ToolsTextCache, tools_schema_text


def _tools(i: int) -> list[dict[str, Any]]:
    schema = {"type": "object", "properties": {}}
    return [{"name": f"tool{i}", "description": "d\u00e9j\u00e0 vu", "input_schema": schema}]


def test_cached_text_equals_uncached_text() -> None:
    cache = ToolsTextCache()
    tools = _tools(1) + _tools(2)
    assert cache.text(tools) == tools_schema_text(tools)
    assert cache.text(tools) == tools_schema_text(tools) and len(cache) == 1


def test_least_recently_used_entry_goes_first() -> None:
    cache = ToolsTextCache(max_entries=2)
    a, b, c = _tools(1), _tools(2), _tools(3)
    text_a = cache.text(a)
    text_b = cache.text(b)
    assert cache.text(a) is text_a  # a hit: a is now the most recently used
    text_c = cache.text(c)  # evicts b, not a
    assert len(cache) == 2
    assert cache.text(a) is text_a and cache.text(c) is text_c
    again_b = cache.text(b)  # a miss: recomputed (equal text, a new string), evicting a
    assert again_b == text_b and again_b is not text_b and len(cache) == 2
    assert cache.text(c) is text_c and cache.text(a) is not text_a


def test_not_plain_json_is_not_cached() -> None:
    cache = ToolsTextCache()
    tools = [{"name": "t", "big": 2**70}]  # orjson refuses ints over 64 bits; json.dumps prints it
    assert cache.text(tools) == tools_schema_text(tools) and len(cache) == 0
