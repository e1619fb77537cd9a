"""An asyncio event loop that runs on virtual time, so real async code can be simulated.

The project's cache code (``cache/manager.py``, ``cache/admission.py``) is asyncio code that
sleeps, waits on events and awaits the rank client. Running it under this loop turns every
``asyncio.sleep`` / ``wait_for`` timeout into a jump of the virtual clock: when no callback is
ready, the selector "waits" by advancing ``time()`` to the next timer instead of blocking. There is
no I/O: a loop with no ready callback and no timer is a deadlock of the simulated system and
raises ``SimulationDeadlock`` (the bookkeeping tests rely on that instead of hanging).

The cache tests run on it too (``tests/cache/conftest.py`` installs ``VirtualTimePolicy``, so each
``asyncio.run`` gets a virtual-time loop): work that is ready takes no virtual time and timers fire
in virtual-time order, so which callbacks run in which order, and what time the policy sees, is a
function of the test alone, not of the machine's speed or load.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationDeadlock(RuntimeError):
    """Every task waits on something that no timer or callback will ever set."""


class _VirtualSelector(selectors.BaseSelector):
    """Holds registrations (the loop's self-pipe) but never reports I/O; select() moves time."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop
        self._keys: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._keys.pop(fd)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        self.unregister(fileobj)
        return self.register(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise SimulationDeadlock("no ready callback and no timer: every task is blocked")
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return dict(self._keys)

    def close(self) -> None:
        self._keys.clear()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """``time()`` is virtual seconds from 0; idle waits advance it instantly."""

    def __init__(self) -> None:
        self._virtual_now_s = 0.0
        super().__init__(selector=_VirtualSelector(self))

    def time(self) -> float:
        return self._virtual_now_s

    def advance(self, seconds: float) -> None:
        self._virtual_now_s += seconds


class VirtualTimePolicy(asyncio.DefaultEventLoopPolicy):
    """``asyncio.run`` (and ``new_event_loop``) under this policy runs on virtual time."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return VirtualTimeLoop()


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh virtual-time loop and close it."""
    loop = VirtualTimeLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
