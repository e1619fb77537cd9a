"""L3: the KV tier shared by every node of a deployment (Mooncake Store behind ``RemoteKV``).

It moves chain blocks between the shared L1 host pool (``HostSlots``) and a cross-node store,
one object per block (``cache/l3_format.py``: our own header with the stamp, chain and parent
hash and an xxh3 of the payload), through two staging buffers registered with the store: the
bytes go host slots -> staging -> network on a save and network -> staging -> (verified) host
slots on a load, so nothing the network delivers reaches a host slot before it is checked, and a
call that hangs past its timeout holds only its staging buffer, never the caller's slots.

* ``probe`` (before a turn is planned): one batched existence query for the blocks of the prompt
  it does not know yet; what the store holds joins ``known`` (this node's view of the store).
* ``match``: the leading blocks in ``known``, or 0 when restoring them is estimated slower than
  recomputing them: ``latency + bytes / bandwidth`` (both measured on this node's own calls,
  moving averages) against ``tokens / prefill_tokens_per_s``. It does no I/O.
* ``save`` (write-behind, from ``TierLink.spill``): batched puts of the blocks the store lacks;
  best-effort: a full pool or an absent holder stores fewer, never an error.
* ``load``: batched gets; returns the leading blocks that arrived and passed every check. A
  missing, short, foreign or garbled object ends the restore there (the turn recomputes the
  rest) and is not asked for again for ``retry_s``.

Failure is never the client's problem: every store call runs on this store's threads under a
timeout. A call that times out or raises, or an existence query the store cannot answer, turns
L3 off for ``retry_s`` (a log line, ``l3_outages``, ``l3_up`` 0 on ``/metrics``): the client is
dropped and ``known`` forgotten (a restarted master has lost every key); the first call after
that reconnects. While off, L3 matches nothing and stores nothing.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from cache.hashing import BlockHash
from cache.host_slots import HostSlots
from cache.l2_format import L2Stamp
from cache.l3_client import RemoteKV, close_when_done, in_daemon_thread
from cache.l3_format import HEADER_BYTES, check_object, object_bytes, object_key, stamp_digest, write_header

log = logging.getLogger(__name__)

T = TypeVar("T")
MIB = 1 << 20
PROBE_FIRST = 64  # an existence query asks for this many blocks first, the rest only if all are there
EWMA = 0.3


@dataclass(slots=True)
class L3Counters:
    saved_blocks: int = 0
    saved_bytes: int = 0
    put_failures: int = 0  # objects the store did not take (pool full, no holder)
    skipped_saves: int = 0  # saves not tried: L3 off
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    get_failures: int = 0  # matched objects that did not arrive (evicted, a holder gone)
    rejected_objects: int = 0  # arrived but failed a check (stamp, hashes, size, checksum)
    probed_blocks: int = 0
    found_blocks: int = 0
    slower_than_prefill: int = 0  # probes whose find was not worth restoring
    timeouts: int = 0
    outages: int = 0  # times L3 was turned off for retry_s


class L3Store:
    """See the module docstring. ``connect`` makes a ``RemoteKV`` (blocking; run on a thread).
    ``root``: the chain's root hash (parent of block 0). One event loop."""

    shared = True  # every worker's store (cache/kv_tier.py)

    def __init__(
        self, connect: Callable[[], RemoteKV], stamp: L2Stamp, host: HostSlots, root: BlockHash, *,
        namespace: str = "dib", staging_bytes: int = 64 * MIB, call_timeout_s: float = 2.0,
        probe_timeout_s: float = 0.5, connect_timeout_s: float = 10.0, retry_s: float = 30.0,
        prefill_tokens_per_s: float = 352_000.0, assumed_bytes_per_s: float = 1e9,
        assumed_latency_s: float = 1e-3, max_known: int = 1 << 21,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        host.check_row_bytes(stamp.bytes_per_block)
        self._connect = connect
        self.stamp = stamp
        self.host = host
        self.root = root
        self.namespace = namespace
        self.digest = stamp_digest(stamp)
        self.object_bytes = object_bytes(stamp.bytes_per_block)
        half = max(self.object_bytes, staging_bytes // 2)
        self.blocks_per_call = half // self.object_bytes
        self._buffers = [_anonymous(self.blocks_per_call * self.object_bytes) for _ in range(2)]
        self.call_timeout_s = call_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry_s = retry_s
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.bytes_per_s = assumed_bytes_per_s  # measured on gets and puts (moving average)
        self.latency_s = assumed_latency_s  # measured on existence queries
        self.max_known = max_known
        self.counters = L3Counters()
        self.off_reason: str | None = "not connected yet"
        self._clock = clock
        self._client: RemoteKV | None = None
        self._reconnect: asyncio.Future[None] | None = None
        self._local = ThreadPoolExecutor(max_workers=2, thread_name_prefix="l3-copy")
        self._known: collections.OrderedDict[BlockHash, None] = collections.OrderedDict()
        self._bad: dict[BlockHash, float] = {}  # hash -> until when a failed object is not asked for
        self._down_until = -1e18
        self._connecting = asyncio.Lock()
        self._locks = [asyncio.Lock(), asyncio.Lock()]  # 0: saves, 1: loads (one staging buffer each)
        self._busy = [False, False]  # a timed-out call still writes or reads that buffer
        self._last_warning: dict[str, float] = {}

    # ----------------------------------------------------------------- state

    @property
    def up(self) -> bool:
        return self._client is not None

    @property
    def known_blocks(self) -> int:
        return len(self._known)

    def close(self) -> None:
        self._drop_client()
        self._local.shutdown(wait=True)

    async def start(self) -> bool:
        """Fault the staging buffers in (not in the first restore) and connect; False leaves L3
        off until the next try."""
        for buf in self._buffers:
            await asyncio.to_thread(buf.fill, 0)
        await self._connect_now()
        return self._client is not None

    # ----------------------------------------------------------------- lookups

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks known in the store and worth restoring (see the module docstring)."""
        if self._client is None:
            return 0
        n = self._leading_known(hashes)
        return n if n and self.worth_restoring(n) else 0

    def stored(self, hashes: Sequence[BlockHash]) -> int:
        return self._leading_known(hashes) if self._client is not None else len(hashes)

    def worth_restoring(self, num_blocks: int) -> bool:
        fetch_s = self.latency_s + num_blocks * self.object_bytes / self.bytes_per_s
        return fetch_s <= num_blocks * self.stamp.block_size / self.prefill_tokens_per_s

    def _leading_known(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self._known:
                break
            n += 1
        return n

    async def probe(self, hashes: Sequence[BlockHash]) -> None:
        """Learn which of the chain's leading blocks the store holds (one or two batched queries)."""
        client = await self._ensure()
        start = self._leading_known(hashes)
        if client is None or start >= len(hashes):
            return
        now = self._clock()
        todo = list(hashes[start:])
        for part in (todo[:PROBE_FIRST], todo[PROBE_FIRST:]):
            if not part:
                return
            if any(self._bad.get(h, -1.0) > now for h in part):
                part = part[: next(i for i, h in enumerate(part) if self._bad.get(h, -1.0) > now)]
            if not part:
                return
            keys = [self._key(h) for h in part]
            began = time.perf_counter()
            found = await self._call(client, self.probe_timeout_s, "probe", client.exists, keys)
            if found is None:
                return
            self.latency_s += EWMA * (time.perf_counter() - began - self.latency_s)
            self.counters.probed_blocks += len(keys)
            if any(x < 0 for x in found):
                self._trip("the store could not answer an existence query")
                return
            num = next((i for i, x in enumerate(found) if x != 1), len(found))
            self._learn(part[:num])
            self.counters.found_blocks += num
            if num < len(part):
                break
        if 0 < self._leading_known(hashes) and not self.worth_restoring(self._leading_known(hashes)):
            self.counters.slower_than_prefill += 1

    # ----------------------------------------------------------------- save

    async def save(self, hashes: Sequence[BlockHash], parent_hash: BlockHash, host_slot: int) -> int:
        """Store the chain's blocks the store is not known to hold (block ``i`` in host slot
        ``host_slot + i``; the caller keeps the slots unchanged until this returns). Returns
        the blocks newly stored; failures store fewer, never raise."""
        n = len(hashes)
        if await self._ensure() is None:
            self.counters.skipped_saves += 1
            return 0
        k = self._leading_known(hashes)
        if k >= n:
            return 0
        stored = 0
        async with self._locks[0]:
            client = self._client
            if client is None or self._busy[0]:
                self.counters.skipped_saves += 1
                return 0
            for first in range(k, n, self.blocks_per_call):
                count = min(self.blocks_per_call, n - first)
                parent = hashes[first - 1] if first else parent_hash
                sizes = await self._local_run(self._pack, hashes, first, count, parent, host_slot + first)
                keys = [self._key(h) for h in hashes[first : first + count]]
                began = time.perf_counter()
                res = await self._call(client, self.call_timeout_s, "save", client.put_from, keys,
                                       self._addresses(0, count), sizes, buffer=0)
                if res is None:
                    break
                self._measure(sum(sizes), time.perf_counter() - began)
                ok = [h for h, r in zip(hashes[first : first + count], res, strict=True) if r == 0]
                self._learn(ok)
                stored += len(ok)
                if len(ok) < count:
                    self.counters.put_failures += count - len(ok)
                    self._warn("put", "L3: the store took %d of %d blocks (pool full or no holder); "
                               "the rest stay on this node only", len(ok), count)
                    break
        self.counters.saved_blocks += stored
        self.counters.saved_bytes += stored * self.stamp.bytes_per_block
        return stored

    def _pack(self, hashes: Sequence[BlockHash], first: int, count: int, parent: BlockHash,
              host_slot: int) -> list[int]:
        """Copy blocks into the save buffer behind their headers (a local thread)."""
        buf = self._buffers[0]
        src = self.host.run(host_slot, count)
        bpb, obj = self.stamp.bytes_per_block, self.object_bytes
        for i in range(count):
            dst = buf[i * obj : (i + 1) * obj]
            dst[HEADER_BYTES:] = src[i * bpb : (i + 1) * bpb]
            write_header(dst, self.digest, hashes[first + i], parent)
            parent = hashes[first + i]
        return [obj] * count

    # ----------------------------------------------------------------- load

    async def load(self, hashes: Sequence[BlockHash], first: int, count: int, host_slot: int) -> int:
        """Copy blocks ``first .. first+count-1`` into host slots from ``host_slot``; returns how
        many leading ones arrived verified (the slots after those are untouched)."""
        count = min(count, self._leading_known(hashes) - first)
        if count <= 0 or self._client is None:
            return 0
        verified = 0
        async with self._locks[1]:
            client = self._client
            if client is None or self._busy[1]:
                return 0
            while verified < count:
                at = first + verified
                num = min(self.blocks_per_call, count - verified)
                keys = [self._key(h) for h in hashes[at : at + num]]
                began = time.perf_counter()
                res = await self._call(client, self.call_timeout_s, "load", client.get_into, keys,
                                       self._addresses(1, num), [self.object_bytes] * num, buffer=1)
                if res is None:
                    break
                got, failure = await self._local_run(self._unpack, hashes, at, res, host_slot + verified)
                if failure is not None:
                    self._reject(hashes[at + got], *failure)
                self._measure(got * self.object_bytes, time.perf_counter() - began)
                verified += got
                if got < num:
                    break
        self.counters.loaded_blocks += verified
        self.counters.loaded_bytes += verified * self.stamp.bytes_per_block
        return verified

    def _unpack(self, hashes: Sequence[BlockHash], at: int, sizes: list[int],
                host_slot: int) -> tuple[int, tuple[str, bool] | None]:
        """Check each object in the load buffer and copy its payload to its host slot, up to the
        first that fails (a local thread): how many, and why the next one failed."""
        buf = self._buffers[1]
        obj, bpb = self.object_bytes, self.stamp.bytes_per_block
        for i, size in enumerate(sizes):
            h = hashes[at + i]
            parent = hashes[at + i - 1] if at + i else self.root
            if size != obj:
                why = "absent or unreadable" if size < 0 else f"{size} bytes"
                return i, (f"chain block {at + i} did not arrive ({why})", False)
            src = buf[i * obj : (i + 1) * obj]
            reason = check_object(src, self.digest, h, parent)
            if reason is not None:
                return i, (f"chain block {at + i} was dropped: {reason}", True)
            self.host.run(host_slot + i, 1)[:] = src[HEADER_BYTES:HEADER_BYTES + bpb]
        return len(sizes), None

    def _reject(self, h: BlockHash, what: str, rejected: bool) -> None:
        if rejected:
            self.counters.rejected_objects += 1
        else:
            self.counters.get_failures += 1
        self._known.pop(h, None)
        self._bad[h] = self._clock() + self.retry_s
        if len(self._bad) > 65536:
            self._bad.clear()
        log.warning("L3: %s; the turn recomputes from there", what)

    # ----------------------------------------------------------------- calls

    async def _ensure(self) -> RemoteKV | None:
        """The client, or None while L3 is off; once ``retry_s`` has passed, a reconnect starts in
        the background (a turn never waits for one: with the master down it can take minutes)."""
        if self._client is None and self._clock() >= self._down_until and (
                self._reconnect is None or self._reconnect.done()):
            self._reconnect = asyncio.ensure_future(self._connect_now())
        return self._client

    async def _connect_now(self) -> None:
        async with self._connecting:
            if self._client is not None or self._clock() < self._down_until:
                return
            future = in_daemon_thread(self._connect_and_register)
            try:
                client = await asyncio.wait_for(asyncio.shield(future), self.connect_timeout_s)
            except Exception as exc:  # noqa: BLE001 - any failure to connect leaves L3 off
                future.add_done_callback(close_when_done)
                self._down_until = self._clock() + self.retry_s
                self.off_reason = (f"no answer from the master in {self.connect_timeout_s:.0f} s"
                                   if isinstance(exc, asyncio.TimeoutError) else f"cannot connect: {exc!r}")
                self._warn("connect", "L3 off for %.0f s: %s", self.retry_s, self.off_reason)
                return
            self._client, self.off_reason = client, None
            log.info("L3 on: %d-block calls of %d bytes per object", self.blocks_per_call, self.object_bytes)

    def _connect_and_register(self) -> RemoteKV:
        client = self._connect()
        try:
            for buf in self._buffers:
                client.register(buf.ctypes.data, buf.nbytes)
        except BaseException:
            client.close()
            raise
        return client

    async def _call(self, client: RemoteKV, timeout_s: float, what: str, fn: Callable[..., T], *args: Any,
                    buffer: int | None = None) -> T | None:
        """``fn(*args)`` on the client's threads; None (and L3 off) when it raises or times out.
        ``buffer``: the staging buffer it uses stays busy until it has really ended."""
        if client is not self._client:
            return None
        future = in_daemon_thread(fn, *args)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            self.counters.timeouts += 1
            reason = f"a {what} call took over {timeout_s:.1f} s (master or holder unreachable?)"
        except asyncio.CancelledError:
            self._hold_buffer(future, buffer)
            raise
        except Exception as exc:  # noqa: BLE001 - the store's errors end in "L3 off", never the turn's
            reason = f"a {what} call failed: {exc!r}"
        self._hold_buffer(future, buffer)
        self._trip(reason)
        return None

    def _hold_buffer(self, future: asyncio.Future[Any], buffer: int | None) -> None:
        if buffer is None or future.done():
            return
        self._busy[buffer] = True

        def release(_: asyncio.Future[Any], i: int = buffer) -> None:
            self._busy[i] = False

        future.add_done_callback(release)

    async def _local_run(self, fn: Callable[..., T], *args: Any) -> T:
        """A local copy step: it touches host slots, so it always runs to its end, even if the
        caller is cancelled meanwhile (then the cancellation is raised after it)."""
        future = asyncio.get_running_loop().run_in_executor(self._local, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await asyncio.wait([future])
            raise

    def _trip(self, reason: str) -> None:
        self.counters.outages += 1
        self.off_reason = reason
        self._down_until = self._clock() + self.retry_s
        log.warning("L3 off for %.0f s: %s; turns go on without it", self.retry_s, reason)
        self._drop_client()

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        self._known.clear()  # a master that restarted has lost every key
        if client is not None:
            threading.Thread(target=client.close, name="l3-close", daemon=True).start()

    # ----------------------------------------------------------------- helpers

    def _key(self, h: BlockHash) -> str:
        return object_key(self.namespace, self.digest, h)

    def _addresses(self, buffer: int, count: int) -> list[int]:
        base = self._buffers[buffer].ctypes.data
        return [base + i * self.object_bytes for i in range(count)]

    def _learn(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            self._known[h] = None
            self._known.move_to_end(h)
            self._bad.pop(h, None)
        while len(self._known) > self.max_known:
            self._known.popitem(last=False)

    def _measure(self, nbytes: int, seconds: float) -> None:
        if nbytes >= 4 * MIB and seconds > 0:  # small calls measure latency, not bandwidth
            self.bytes_per_s += EWMA * (nbytes / seconds - self.bytes_per_s)

    def _warn(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_warning.get(key, -1e9) >= 60.0:
            self._last_warning[key] = now
            log.warning(msg, *args)


def _anonymous(nbytes: int) -> np.ndarray:
    """Page-aligned private memory (the store registers it for zero-copy transfers)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, mmap.PAGESIZE)), dtype=np.uint8)[:nbytes]
