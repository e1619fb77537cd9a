"""What ``cache/`` and ``server/`` see of the rank layer: the ``RankClient`` protocol.

Two implementations: ``rank.group.RankGroup`` (rank processes over zmq, supervised) and
``rank.local_group.LocalRankGroup`` (engines in-process, for tests and the simulator).
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from rank.engine import EngineRequest, EngineStats, RequestOutput
from rank.errors import RankFailed, RankUnavailable
from rank.ids import BlockId, Epoch, HostSlot, Rank

__all__ = ["GroupState", "RankClient", "RankFailed", "RankUnavailable", "RequestStream"]


class GroupState(str, enum.Enum):
    STARTING = "starting"  # ranks launching / loading weights
    READY = "ready"  # accepting requests
    RESTARTING = "restarting"  # a rank died or stalled; the whole group is being replaced
    STOPPED = "stopped"  # close() was called (or never started)
    FAILED = "failed"  # could not (re)start; gives up until restarted by hand


@runtime_checkable
class RankClient(Protocol):
    """A group of ``num_ranks`` engines that step in lockstep.

    Block ids are per rank and valid only within one ``epoch``; when the group restarts, every
    block id and in-flight request of the old epoch is gone (the host pool's file outlives the
    ranks: its slots keep their bytes), and restart listeners are told the new epoch before any
    new request can be submitted.
    """

    num_ranks: int
    block_size: int
    num_blocks: int  # per rank, including scratch block 0
    bytes_per_block: int  # bytes of one KV block row (= one L1 host slot)
    num_host_slots: int  # slots of the shared L1 host pool (0 when there is none)
    epoch: Epoch
    state: GroupState
    # False when any rank's engine cannot start from cached blocks (DeepInfer without the
    # prefix-cache patch): the cache then keeps nothing; the reason is for /healthz and the log.
    prefix_cache_supported: bool
    prefix_cache_reason: str | None

    @property
    def host_pool_path(self) -> str | None:
        """The shared L1 host pool's file (``/dev/shm``), which the L2 store maps too; None when
        the group has no host pool."""
        ...

    async def start(self) -> None:
        """Bring the group up; returns once READY (raises RankFailed if it gives up)."""
        ...

    async def close(self) -> None:
        """Stop every rank and fail anything in flight; nothing of the group is left after it."""
        ...

    def submit(self, rank: Rank, request: EngineRequest) -> RequestStream:
        """Queue a request on ``rank``. Raises RankUnavailable unless READY."""
        ...

    def abort(self, rank: Rank, request_id: str) -> None:
        """Fire and forget; the stream then ends with finish_reason ABORT (if not done yet)."""
        ...

    async def release(self, rank: Rank, block_ids: list[BlockId]) -> None: ...

    async def export_blocks(self, rank: Rank, block_ids: list[BlockId], host_slot: HostSlot) -> None: ...

    async def import_blocks(self, rank: Rank, host_slot: HostSlot, num_blocks: int) -> list[BlockId]: ...

    def stats(self, rank: Rank) -> EngineStats: ...

    def add_restart_listener(self, fn: Callable[[Epoch], None]) -> None: ...

    def health(self) -> dict[str, Any]:
        """Group state for /healthz (JSON-ready): state, epoch, restarts, last failure, ranks."""
        ...


class RequestStream:
    """Async iterator over one request's ``RequestOutput``s; the last has ``finished=True``.

    Producers call ``push`` (outputs, in order) and ``fail`` (the group failed); consumers
    iterate. ``push_tokens`` is the producer's cheap path for a non-final step: while the
    previous non-final output it made is still buffered (the consumer has not taken it), the new
    ids are appended to that output instead of buffering another one, so a consumer that fell
    behind takes one output for several steps (the same ids in the same order) and the producer
    builds no object per request per step. An output is never changed once it was taken.
    Iteration raises the failure (``RankFailed``, or ``EngineMisuse`` when the engine
    rejected the request) after any outputs that arrived before it. ``abort()`` asks the engine
    to stop the request (the stream then ends with an ABORT output). Not thread-safe: producer
    and consumer share one event loop.
    """

    __slots__ = ("request_id", "rank", "epoch", "num_prompt_tokens", "num_cached_tokens", "_outputs",
                 "_error",
                 "_waiter", "_done", "_abort_fn", "_open")

    def __init__(
        self, request_id: str, rank: Rank, epoch: Epoch, abort_fn: Callable[[], None] | None = None,
        *, num_prompt_tokens: int = 0, num_cached_tokens: int = 0,
    ) -> None:
        self.request_id = request_id
        self.rank = rank
        self.epoch = epoch
        self.num_prompt_tokens = num_prompt_tokens  # stamped on the outputs push_tokens makes
        self.num_cached_tokens = num_cached_tokens
        self._outputs: deque[RequestOutput] = deque()
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._done = False  # a finished output or an error was pushed
        self._abort_fn = abort_fn
        self._open: RequestOutput | None = None  # the last output push_tokens made (may still grow)

    @property
    def done(self) -> bool:
        """True once the terminal output (or a failure) has been produced."""
        return self._done

    def push(self, output: RequestOutput) -> None:
        if self._done:
            return  # a late output after a failure; the invariant says none follow a finish
        self._outputs.append(output)
        if output.finished:
            self._done = True
        self._wake()

    def push_tokens(self, token_ids: list[int]) -> None:
        """A non-final step's ids (the list is handed over). See the class docstring."""
        if self._done:
            return
        outputs = self._outputs
        tail = self._open
        if tail is not None and outputs and outputs[-1] is tail:
            tail.token_ids.extend(token_ids)  # still buffered: the consumer was already woken
            return
        tail = self._open = RequestOutput(
            self.request_id, token_ids, False, None, self.num_prompt_tokens, self.num_cached_tokens
        )
        outputs.append(tail)
        self._wake()

    def fail(self, error: BaseException) -> None:
        if self._done:
            return
        self._error = error
        self._done = True
        self._wake()

    def abort(self) -> None:
        if not self._done and self._abort_fn is not None:
            self._abort_fn()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._outputs:
                return self._outputs.popleft()
            if self._error is not None:
                raise self._error
            if self._done:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def drain_nowait(self) -> list[RequestOutput]:
        """Take every output already buffered (lets a consumer batch several steps' tokens)."""
        outputs = list(self._outputs)
        self._outputs.clear()
        return outputs
