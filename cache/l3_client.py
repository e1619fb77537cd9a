"""The client of L3's store: the four blocking calls L3 makes, and Mooncake Store behind them.

``RemoteKV`` is the seam (tests put an in-process fake behind it); ``MooncakeKV`` is Mooncake
Store's Python client (``mooncake.store.MooncakeDistributedStore``, from the optional package
``mooncake-transfer-engine-non-cuda``, imported only when L3 is configured): a ``mooncake_master``
holds the metadata, each backend's client contributes ``segment_bytes`` of its RAM to the pool and
moves objects over TCP (or RDMA) straight between that pool and buffers registered with it.

Every call blocks (a dead master makes each one wait seconds): ``cache/l3_store.py`` runs them
on its own threads, under timeouts, never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)

MIB = 1 << 20
T = TypeVar("T")


class RemoteKV(Protocol):
    def register(self, address: int, nbytes: int) -> None:
        """Make ``nbytes`` at ``address`` usable by ``put_from`` / ``get_into``. Raises on failure."""
        ...

    def exists(self, keys: list[str]) -> list[int]:
        """Per key: 1 present, 0 absent, < 0 the store could not say."""
        ...

    def put_from(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        """Store each ``sizes[i]`` bytes at ``addresses[i]`` under ``keys[i]``; per key 0 stored
        (or already there), < 0 not stored (pool full, no holder, store down)."""
        ...

    def get_into(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        """Copy each object into its buffer; per key the object's size, or < 0 (absent, a
        vanished holder, a buffer too small)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class MooncakeSettings:
    master: str  # host:port of mooncake_master
    bind_host: str  # the address this client listens on and announces to the others
    segment_bytes: int  # RAM this node lends the pool (0: a client that only reads and writes)
    local_buffer_bytes: int = 16 * MIB  # Mooncake's own transfer buffer (our calls use registered ones)
    protocol: str = "tcp"
    rdma_devices: str = ""
    metadata_server: str = "P2PHANDSHAKE"  # peers exchange segment descriptors directly


def mooncake_available() -> str | None:
    """None when Mooncake's client can be imported; else why not (the package or a library)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or OSError for a missing libibverbs
        return f"{type(exc).__name__}: {exc}"
    return None


class MooncakeKV:
    """``RemoteKV`` over one ``MooncakeDistributedStore``; ``connect`` blocks (seconds)."""

    def __init__(self, store: Any) -> None:
        self._store = store

    @classmethod
    def connect(cls, settings: MooncakeSettings) -> MooncakeKV:
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup(settings.bind_host, settings.metadata_server, settings.segment_bytes,
                         settings.local_buffer_bytes, settings.protocol, settings.rdma_devices,
                         settings.master)
        if rc != 0:
            raise ConnectionError(f"Mooncake Store setup against master {settings.master} failed (code {rc})")
        return cls(store)

    def register(self, address: int, nbytes: int) -> None:
        rc = self._store.register_buffer(address, nbytes)
        if rc != 0:
            raise ConnectionError(f"Mooncake Store register_buffer failed (code {rc})")

    def exists(self, keys: list[str]) -> list[int]:
        return [int(x) for x in self._store.batch_is_exist(keys)]

    def put_from(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        return [int(x) for x in self._store.batch_put_from(keys, addresses, sizes)]

    def get_into(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        return [int(x) for x in self._store.batch_get_into(keys, addresses, sizes)]

    def close(self) -> None:
        try:
            self._store.close()
        except Exception:
            log.debug("L3: closing the Mooncake client failed", exc_info=True)


def in_daemon_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` on a thread of its own that never holds the process up at exit (a store call
    can block for minutes with the master gone; a pool's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def body() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for it
            pass

    threading.Thread(target=body, name="l3-call", daemon=True).start()
    return future


def close_when_done(future: asyncio.Future[Any]) -> None:
    """A done-callback: close the client a connect that nobody waits for any more made."""
    if not future.cancelled() and future.exception() is None:
        future.result().close()
