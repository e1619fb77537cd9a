"""``RankMessenger``: what a ``RankGroup`` sends its ranks and what comes back (messaging).

Out: a request (``add``, its ids as raw int32 bytes, ``rank/wire.py``) or an ``abort`` is sent
without waiting (a request's folded L1 import, ``FoldedImport``, gets a ``cid`` and its
``reply`` future is settled like a command's); a ``release``/``export``/``import`` command gets
a ``cid`` and a future that its reply settles (``command``). Each command is numbered per rank
and goes on zmq or, for transfers once the rank's transfer thread has connected, on the
transfer channel (``RankLink.send``).

In: ``on_message`` is the receive path's callback (``RankLink.receive``, ``rank/link.py``): a step
message's outputs go to the requests' streams (``dispatch``), a reply settles its command, a
``reject`` fails its request's stream with the engine's ``EngineMisuse``; heartbeats, ready and
fatal reports go to ``on_status`` (``RankProcesses``: they are supervision). A step message
costs one header parse and one ``dispatch`` call here, whatever its number of requests.

At the end of an epoch ``fail_all`` fails every stream and pending command of it with the cause.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson
import zmq

from rank import wire
from rank.client import RequestStream
from rank.engine import CapacityExhausted, EngineMisuse, EngineRequest
from rank.errors import RankUnavailable
from rank.ids import Epoch, Rank
from rank.link import RankLink, Tracked, TransferTiming

OnStatus = Callable[[RankLink, dict[str, Any]], None]


class RankMessenger:
    """Requests and commands to the current epoch's ranks and their answers (module docstring).

    Invariant: ``_pending`` holds exactly the commands sent in this epoch whose reply has not come;
    ``fail_all`` empties it and every ``RankLink.requests`` of the epoch."""

    def __init__(self, on_status: OnStatus) -> None:
        self.on_status = on_status
        self.transfer_log: deque[TransferTiming] = deque(maxlen=4096)  # the latest round trips
        self._pending: dict[int, asyncio.Future[Any]] = {}
        # Folded imports in flight (also in ``_pending``): when the add left, its number of blocks.
        self._folds: dict[int, tuple[float, int]] = {}
        self._cids = itertools.count(1)

    @property
    def num_pending(self) -> int:
        """Commands sent whose reply has not come (0 after ``fail_all``)."""
        return len(self._pending)

    # ------------------------------------------------------------------ in

    def on_message(self, r: RankLink, frames: list[bytes]) -> None:
        header = orjson.loads(frames[0])
        kind = header["t"]
        if kind == "step":
            r.stats = header["stats"]
            if len(frames) == 4 and frames[1]:
                self.dispatch(r, header, frames)
        elif kind == "reply":
            self._on_reply(r, header)
        elif kind == "reject":
            req = r.requests.pop(header["h"], None)
            if req is not None:
                req.stream.fail(EngineMisuse(header["msg"]))
        else:
            self.on_status(r, header)

    def dispatch(self, r: RankLink, header: dict[str, Any], frames: list[bytes]) -> None:
        """A step's outputs to their streams; a method of its own, looked up per message:
        ``bench/reliability/storm.py`` wraps it to see terminal outputs."""
        r.dispatch(header, frames)

    def _on_reply(self, r: RankLink, header: dict[str, Any]) -> None:
        if "stats" in header:
            r.stats = header["stats"]
        cid = header["cid"]
        fut = self._pending.pop(cid, None)
        fold = self._folds.pop(cid, None)
        if fut is None or fut.done():
            return
        if fold is not None and header["ok"]:
            now = time.monotonic()
            header["read"] = now
            if (timing := TransferTiming.of("fold", r.rank, fold[0], header, now, fold[1])) is not None:
                self.transfer_log.append(timing)
            fut.set_result(list(header["result"]))
        elif header["ok"]:
            header["read"] = time.monotonic()
            fut.set_result(header)
        else:
            exc_type = CapacityExhausted if header["etype"] == "CapacityExhausted" else EngineMisuse
            fut.set_exception(exc_type(header["msg"]))

    # ------------------------------------------------------------------ out

    @staticmethod
    def send(r: RankLink, header: dict[str, Any], *frames: bytes) -> None:
        try:
            r.send(header, *frames)
        except zmq.ZMQError as exc:
            raise RankUnavailable(f"rank {r.rank} is not reachable: {exc}") from None

    def submit(self, r: RankLink, request: EngineRequest, epoch: Epoch,
               abort: Callable[[], None]) -> RequestStream:
        """Send ``request`` to ``r``; its stream (``abort``: what ``stream.abort()`` calls)."""
        handle = r.next_handle
        r.next_handle = (handle + 1) & 0x7FFFFFFF
        fold = request.fold
        if fold is None:
            self.send(r, *wire.encode_add(request, handle))
        else:
            cid = next(self._cids)
            self._pending[cid] = fold.reply
            self._folds[cid] = (time.monotonic(), fold.num_blocks)
            try:
                self.send(r, *wire.encode_add(request, handle, cid))
            except RankUnavailable:
                del self._pending[cid], self._folds[cid]
                raise
            fold.sent = True
        stream = RequestStream(request.request_id, Rank(r.rank), epoch, abort,
                               num_prompt_tokens=len(request.prompt_ids),
                               num_cached_tokens=request.num_cached_tokens)
        r.requests[handle] = Tracked(stream, request.request_id, stream.push_tokens)
        return stream

    async def command(self, r: RankLink, header: dict[str, Any]) -> Any:
        """Send a ``release``/``export``/``import`` and wait for its reply's result (its
        ``TransferTiming`` goes to ``transfer_log``)."""
        cid = header["cid"] = next(self._cids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[cid] = fut
        sent = time.monotonic()
        try:
            self.send(r, header)
        except RankUnavailable:
            self._pending.pop(cid, None)
            raise
        reply = await fut
        if (timing := TransferTiming.of(header["op"], r.rank, sent, reply, time.monotonic())) is not None:
            self.transfer_log.append(timing)
        return reply["result"]

    # ------------------------------------------------------------------ end of an epoch

    def fail_all(self, links: list[RankLink], error: BaseException) -> int:
        """Fail every in-flight request on ``links`` and every pending command; the number of requests."""
        num_failed = 0
        for r in links:
            for req in r.requests.values():
                req.stream.fail(error)
                num_failed += 1
            r.requests.clear()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        self._pending.clear()
        self._folds.clear()
        return num_failed
