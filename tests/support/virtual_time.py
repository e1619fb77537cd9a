"""Virtual time for asyncio tests (``bench/simulator/vclock.py``): timers fire in an order that
depends on the test alone, not on the machine's load."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from bench.simulator.vclock import VirtualTimePolicy


@contextlib.contextmanager
def virtual_time() -> Iterator[None]:
    """Every event loop made inside runs on virtual time; the previous policy comes back after."""
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(VirtualTimePolicy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(previous)
