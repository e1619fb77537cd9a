"""Where protocol state outlives the process: the seam the ledger and the piece cache write to.

``protocol`` imports nothing of ``cache``/``server``; the server hands in an implementation
(``server/persist.py``: bounded segment files under ``l2_dir``). Without one, state is
in-memory only, as before.

Contract for implementations: ``put`` and ``refresh`` never raise (a full or vanished disk
costs persistence, never a request); ``replay`` yields what earlier processes ``put``, in the
order they put it (a later value for a key replaces an earlier one), possibly less than all of
it (the log is bounded and drops its oldest records first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol


class KeyedLog(Protocol):
    def replay(self) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) records of earlier runs, oldest first."""
        ...

    def put(self, key: bytes, value: bytes) -> None:
        """Record ``value`` for ``key``."""
        ...

    def refresh(self, key: bytes, value: Callable[[], bytes]) -> None:
        """``key`` was used: keep it from aging out (re-put ``value()`` if its record is old)."""
        ...
