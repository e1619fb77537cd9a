"""Every cache test runs on virtual time (``bench/simulator/vclock.py``): its timers (queue
rechecks, force/fail deadlines, release waits, staggered starts, engine steps of ``step_s``) fire
in an order that depends on the test alone, not on the machine's load."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.virtual_time import virtual_time


@pytest.fixture(autouse=True)
def _virtual_time() -> Iterator[None]:
    with virtual_time():
        yield
