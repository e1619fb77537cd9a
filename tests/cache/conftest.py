"""Every cache test runs on virtual time (``bench/simulator/vclock.py``): its timers (queue
rechecks, force/fail deadlines, release waits, staggered starts, engine steps of ``step_s``) fire
in an order that depends on the test alone, not on the machine's load (issue 15 item 9)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from bench.simulator.vclock import VirtualTimePolicy


@pytest.fixture(autouse=True)
def _virtual_time() -> Iterator[None]:
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(VirtualTimePolicy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(previous)
