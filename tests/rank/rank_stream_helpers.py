"""Helpers shared by the rank process tests."""

from __future__ import annotations

from rank.client import RequestStream
from rank.engine import RequestOutput


async def collect(stream: RequestStream) -> tuple[list[int], RequestOutput]:
    """Every token of a request stream and its terminal output (which must be finished)."""
    tokens: list[int] = []
    last = None
    async for out in stream:
        tokens += out.token_ids
        last = out
    assert last is not None and last.finished
    return tokens, last
