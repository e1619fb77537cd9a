"""One admitted turn: the ``Admission`` receipt and the ``Turn`` that settles it exactly once.

Callers use the manager's context manager instead of hand-written admit/try/abort/finish::

    async with cache.turn(prompt_ids, session_hint, max_tokens) as turn:
        sampling = SamplingParams(max_tokens=turn.admission.max_output_tokens, ...)
        stream = client.submit(turn.rank, turn.engine_request(request_id, sampling))
        async for out in stream:
            turn.feed(out)            # collects the output, grows the KV room ahead of decode
        turn.stop_kind = StopKind.TOOL_USE

On enter the turn is admitted (routed, queued, restored: ``CacheManager.admit``). On a normal
exit it is filed (``finish``) when its last output is terminal, else aborted; on an exception or
a cancellation it is aborted. ``finish``/``settle``/``abort`` settle it earlier (a second settle is
a no-op), and ``hand_off`` leaves it to the caller past the block (a stream that must be drained
in the background first: ``server/service.py``).

A caller drives the turn through its methods only: ``feed``/``feed_batch`` while it listens,
``keep`` for outputs that arrive after it stopped (they are filed, no room is grown), the
``stop_kind`` setter, then a settle. What it reads is read-only: ``output_ids`` (a copy),
``last_output``, and ``admission``, an ``AdmissionView``: the admitted turn's figures, never the
manager's ``Admission`` (its use refs, reservations and room are the cache's to change).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from cache.hashing import BlockHash, as_token_array
from cache.sessions import SessionId, StopKind
from rank.engine import EngineRequest, FoldedImport, RequestOutput, SamplingParams
from rank.ids import BlockId, Epoch, Rank

if TYPE_CHECKING:
    from cache.manager import CacheManager


class Tier(str, enum.Enum):
    """Where a turn's cached prefix tokens came from (the metrics' ``tier`` label)."""

    L0 = "l0"  # resident on the rank's GPU
    L1 = "l1"  # restored from the shared host pool
    L2 = "l2"  # read from disk into the host pool, then restored (``cache/kv_tier.py``)


@dataclass(slots=True)
class TierTokens:
    """Cached prompt tokens of one turn by tier (all count as cached tokens in usage)."""

    l0: int = 0
    l1: int = 0
    l2: int = 0

    def __getitem__(self, tier: Tier) -> int:
        return int(getattr(self, Tier(tier).value))

    def __setitem__(self, tier: Tier, num_tokens: int) -> None:
        setattr(self, Tier(tier).value, num_tokens)

    def items(self) -> Iterator[tuple[Tier, int]]:
        for tier in Tier:
            yield tier, self[tier]


@dataclass(slots=True, eq=False)
class Admission:
    """The manager's receipt for one admitted turn (use refs held, blocks reserved, the room it
    may grow into). Only the cache's parts read or change it; a ``Turn``'s caller sees the
    ``AdmissionView``."""

    rank: Rank
    prefix_blocks: list[BlockId]
    num_cached_tokens: int
    cached_tokens_by_tier: TierTokens
    queue_time_s: float
    restore_s: float
    session_id: SessionId
    epoch: Epoch
    keep_blocks: bool
    num_prompt_tokens: int
    hashes: list[BlockHash] = field(repr=False)
    num_used_blocks: int = 0  # use refs held on hashes[:num_used_blocks] on ``rank``
    # Its shares of the rank's ledger (``cache/ledger.py`` alone changes them, with the ledger's):
    reserved_blocks: int = 0  # blocks the sequence may still allocate (released at close)
    running_tokens: int = 0  # its context (prompt + the room it may fill): the router's load
    worst_blocks: int = 0  # prompt + the output it may reach, blocks: counted in the rank's worst case
    max_output_tokens: int = 1  # the engine request's max_tokens (trimmed to the KV room if a default)
    room_blocks: int = 0  # blocks the turn may hold: prefix + reserved; grows while it decodes
    is_closed: bool = False
    caller_salt: bytes = b""  # the chain's per-caller salt (``ChainHasher``), b"" when shared
    # A restore that rides in this turn's add (``cache/l1_restores.py``), until its reply: the
    # blocks after ``prefix_blocks`` that ``num_cached_tokens`` already counts.
    fold: FoldedImport | None = None

    def engine_request(
        self, request_id: str, prompt_ids: np.ndarray, sampling: SamplingParams
    ) -> EngineRequest:
        return EngineRequest(
            request_id=request_id,
            prompt_ids=as_token_array(prompt_ids),
            sampling=sampling,
            prefix_blocks=list(self.prefix_blocks),
            num_cached_tokens=self.num_cached_tokens,
            keep_blocks=self.keep_blocks,
            fold=self.fold,
        )


@dataclass(frozen=True, slots=True)
class AdmissionView:
    """What a turn was admitted with, for its caller (``Turn.admission``): a frozen copy taken
    when the turn starts (admission, routing and restore are over by then)."""

    rank: Rank
    session_id: SessionId
    num_prompt_tokens: int
    num_cached_tokens: int
    cached_tokens_by_tier: TierTokens  # a copy: changing it changes nothing in the cache
    max_output_tokens: int  # the engine request's max_tokens (trimmed to the KV room if a default)
    queue_time_s: float
    restore_s: float
    keep_blocks: bool

    @classmethod
    def of(cls, adm: Admission) -> AdmissionView:
        by_tier = adm.cached_tokens_by_tier
        return cls(rank=adm.rank, session_id=adm.session_id, num_prompt_tokens=adm.num_prompt_tokens,
                   num_cached_tokens=adm.num_cached_tokens,
                   cached_tokens_by_tier=TierTokens(by_tier.l0, by_tier.l1, by_tier.l2),
                   max_output_tokens=adm.max_output_tokens, queue_time_s=adm.queue_time_s,
                   restore_s=adm.restore_s, keep_blocks=adm.keep_blocks)


class Turn:
    """An admitted turn inside ``async with cache.turn(...)`` (see the module docstring)."""

    __slots__ = (
        "_cache",
        "_admission",
        "_view",
        "_prompt_ids",
        "_output_ids",
        "_last_output",
        "_stop_kind",
        "_settled",
        "_handed_off",
    )

    def __init__(self, cache: CacheManager, admission: Admission, prompt_ids: np.ndarray) -> None:
        self._cache = cache
        self._admission = admission
        self._view = AdmissionView.of(admission)
        self._prompt_ids = prompt_ids
        self._output_ids: list[int] = []
        self._last_output: RequestOutput | None = None
        self._stop_kind = StopKind.UNKNOWN  # what the finish learns (the protocol knows it)
        self._settled = False
        self._handed_off = False

    # -- what the caller reads -----------------------------------------------------------------
    @property
    def admission(self) -> AdmissionView:
        return self._view

    @property
    def rank(self) -> Rank:
        return self._view.rank

    @property
    def settled(self) -> bool:
        return self._settled

    @property
    def prompt_ids(self) -> np.ndarray:
        return self._prompt_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self._prompt_ids)

    @property
    def output_ids(self) -> tuple[int, ...]:
        """The output ids taken so far (a copy: ``feed`` and ``keep`` are the only writers)."""
        return tuple(self._output_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_ids)

    @property
    def last_output(self) -> RequestOutput | None:
        return self._last_output

    @property
    def stop_kind(self) -> StopKind:
        return self._stop_kind

    @stop_kind.setter
    def stop_kind(self, kind: StopKind) -> None:
        """How the turn ended (the protocol knows: a tool call, the end of the answer), filed
        with it for the session's gap model and eviction value."""
        self._stop_kind = StopKind(kind)

    # -- what the caller does ------------------------------------------------------------------
    def engine_request(self, request_id: str, sampling: SamplingParams) -> EngineRequest:
        return self._admission.engine_request(request_id, self._prompt_ids, sampling)

    async def settle_fold(self) -> None:
        """After ``engine_request`` was submitted: wait for its folded L1 restore's reply, if it
        has one (it comes before the turn's first output), then take the admission's final
        figures. A failed fold lowers the cached count (the rank computes that part), and the
        usage a client is told must say what was really cached."""
        fold = self._admission.fold
        if fold is not None:
            await asyncio.wait([fold.reply])
        self._view = AdmissionView.of(self._admission)

    def feed(self, output: RequestOutput) -> None:
        """One output of the turn's engine stream arrived: keep it, grow the KV room."""
        self._last_output = output
        if output.token_ids:
            self._output_ids.extend(output.token_ids)
            self._cache.make_room(self._admission, len(self._output_ids))

    def feed_batch(self, outputs: list[RequestOutput]) -> list[int]:
        """Several outputs at once (a stream that fell behind catches up): keep them, grow the
        KV room once; returns their token ids in order."""
        tokens = [t for out in outputs for t in out.token_ids]
        self._last_output = outputs[-1]
        if tokens:
            self._output_ids.extend(tokens)
            self._cache.make_room(self._admission, len(self._output_ids))
        return tokens

    def keep(self, output: RequestOutput) -> None:
        """An output that arrived after the caller stopped listening (the engine request is
        being aborted): kept so that ``settle`` files what its terminal output hands over; no
        room is grown for a request that is ending."""
        self._output_ids.extend(output.token_ids)
        self._last_output = output

    def finish(self, stop_kind: StopKind | None = None) -> None:
        """The turn ended normally with ``last_output``: file its kept blocks now."""
        if self._settled:
            return
        self._settled = True
        output = self._last_output
        if output is None:
            self._cache.abort(self._admission)
            return
        if stop_kind is not None:
            self.stop_kind = stop_kind
        self._cache.finish(self._admission, self._prompt_ids, np.asarray(self._output_ids, dtype=np.int32),
                           output, self._stop_kind)

    def settle(self) -> None:
        """Settle a turn we stopped listening to: file it when its terminal output handed blocks
        to the cache (filing them is the only way they are released), else abort it."""
        last = self._last_output
        if last is not None and last.finished and last.kept_blocks:
            self.finish()
        else:
            self.abort()

    def abort(self) -> None:
        """No terminal output to file (submit failed, the group failed, the caller gave up)."""
        if not self._settled:
            self._settled = True
            self._cache.abort(self._admission)

    def hand_off(self) -> None:
        """Leaving the ``async with`` block does not settle the turn: the caller will."""
        self._handed_off = True

    def exit(self, ok: bool) -> None:
        """The ``async with`` block ended (``ok``: without an exception)."""
        if self._handed_off or self._settled:
            return
        if ok and self._last_output is not None and self._last_output.finished:
            self.finish()
        else:
            self.abort()
