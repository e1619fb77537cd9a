"""Bounded in-memory store of Responses API responses (``store: true``, the API's default).

It serves ``previous_response_id`` (the stored response's own input items and output items,
chained through its own ``previous_response_id``) and ``item_reference`` inputs (an output item
by its id; the Vercel AI SDK's OpenAI provider sends those with ``store: true``). Each response
keeps only the items its request added, so a long chain costs its new items once. Memory is
bounded by bytes (LRU; the JSON size of the items); a reference to an evicted or unknown
response or item is a 400 that says to send the full input instead. The store lives in the
backend process: a restart empties it.

Owner: each response is stored with its caller's scope (a hash of the API key it came with,
``server/auth.caller_scope``; b"" without one) and is found only by that scope, together with
its items: another caller's ``previous_response_id`` or ``item_reference`` reads as not stored.
Ids are 128 random bits, so they cannot be guessed either (callers with no key, or behind a
platform that shows one key for everyone, share one scope: then the id alone protects).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

_OVERHEAD_BYTES = 256
MAX_CHAIN = 10_000  # previous_response_id links followed at most (a cycle cannot form; a bound anyway)


@dataclass(slots=True)
class StoredResponse:
    owner: bytes
    previous_id: str | None
    input_items: list[dict[str, Any]]
    output_items: list[dict[str, Any]]
    nbytes: int


class ResponseStore:
    """Thread-safe; shared by all sessions of one backend."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._items: dict[str, tuple[bytes, dict[str, Any]]] = {}  # id -> (owner, item)
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.num_evictions = 0

    def record(self, response_id: str, owner: bytes, previous_id: str | None,
               input_items: list[dict[str, Any]], output_items: list[dict[str, Any]]) -> None:
        size = len(orjson.dumps(input_items)) + len(orjson.dumps(output_items)) + _OVERHEAD_BYTES
        if size > self.max_bytes:
            return
        entry = StoredResponse(owner, previous_id, input_items, output_items, size)
        with self._lock:
            self._responses[response_id] = entry
            for item in output_items:
                if isinstance(item.get("id"), str):
                    self._items[item["id"]] = (owner, item)
            self.num_bytes += size
            while self.num_bytes > self.max_bytes and self._responses:
                _, old = self._responses.popitem(last=False)
                self.num_bytes -= old.nbytes
                self.num_evictions += 1
                for item in old.output_items:
                    self._items.pop(item.get("id"), None)  # type: ignore[arg-type]

    def history(self, response_id: str, owner: bytes) -> list[dict[str, Any]] | None:
        """All items of the chain ending at ``response_id`` (oldest first), or None if any
        response of the chain is not stored or not ``owner``'s."""
        chain: list[StoredResponse] = []
        with self._lock:
            rid: str | None = response_id
            while rid is not None and len(chain) < MAX_CHAIN:
                entry = self._responses.get(rid)
                if entry is None or entry.owner != owner:
                    return None
                self._responses.move_to_end(rid)
                chain.append(entry)
                rid = entry.previous_id
        items: list[dict[str, Any]] = []
        for entry in reversed(chain):
            items.extend(entry.input_items)
            items.extend(entry.output_items)
        return items

    def item(self, item_id: str, owner: bytes) -> dict[str, Any] | None:
        with self._lock:
            found = self._items.get(item_id)
        return found[1] if found is not None and found[0] == owner else None
