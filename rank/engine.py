"""The narrow interface a rank loop drives, implemented by the reference engine and DeepInfer.

Everything above this interface (cache tiers, routing, lockstep loop, protocol, server) is the
same code for both engines.

Invariants every implementation keeps (tests/engines/test_engine_contract.py checks them on each):

* Blocks. A rank owns ``num_blocks`` KV blocks of ``block_size`` tokens. Block 0 is scratch and
  is never handed out, so valid ids are ``1 .. num_blocks-1``. Every block has a reference count;
  a block is free exactly when its count is 0. Holders are: a live sequence (one ref per block in
  its table) and the cache (one ref per block it was handed by ``kept_blocks`` or
  ``import_blocks``). ``release`` drops one cache ref. Nothing else changes counts.
* Prefix start. ``add`` with ``prefix_blocks`` takes one sequence ref on each of them (the cache
  keeps its own) and computes only ``prompt_ids[num_cached_tokens:]``. The caller guarantees
  ``num_cached_tokens == block_size * len(prefix_blocks)`` and ``num_cached_tokens <=
  len(prompt_ids) - 1``; the engine validates both, plus ids in range, no duplicates and a
  positive ref count on each, and raises ``EngineMisuse`` *before changing any state*.
  Shared (prefix) blocks are never written. Which matched blocks to pass is decided by
  ``usable_prefix_blocks`` below: the last matched block is always recomputed (replayed), as the
  DeepInfer prefix-cache patch requires for its sliding-window state; the reference engine
  follows the same rule so both report the same cached-token counts.
* Outputs. ``step`` returns at most one ``RequestOutput`` per request per step; each request
  gets exactly one output with ``finished=True`` (including aborted ones) and none after it.
* Finish. When a request finishes with ``keep_blocks=True`` (and not aborted), its full blocks
  are handed to the cache in ``kept_blocks``: block ``i`` holds the KV of tokens
  ``[i*block_size, (i+1)*block_size)`` of ``prompt_ids ++ output_ids``; there are
  ``(len(prompt)+len(output)-1) // block_size`` of them (the last sampled token has no KV yet).
  The sequence's refs on those blocks become cache refs; its other blocks are freed. An aborted
  or failed request keeps nothing.
* Host tier. ``export_blocks`` copies blocks (which stay allocated) into consecutive slots of the
  shared L1 host pool starting at ``host_slot``; ``import_blocks`` allocates fresh blocks (one cache
  ref each) and copies consecutive host slots into them, or raises ``CapacityExhausted`` without
  side effects. Data written by an import is in place before any later ``step`` reads it.
* Accounting. ``stats().num_free_blocks + blocks with a nonzero count == num_blocks - 1`` always;
  ``check_accounting`` asserts the full per-block bookkeeping (tests call it after every scenario).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from rank.ids import BlockId, HostSlot

if TYPE_CHECKING:
    import asyncio

    from rank.host_pool import HostPool

DEFAULT_BLOCK_SIZE = 128


class EngineMisuse(ValueError):
    """A call that breaks the interface contract; raised before any state changes."""


class CapacityExhausted(RuntimeError):
    """Not enough free blocks (or host slots) for the operation; nothing was changed."""


def checked_host_pool(pool: HostPool | None, host_slot: int, num_blocks: int) -> HostPool:
    """The pool an engine's ``import_blocks``/``export_blocks`` may use for ``num_blocks`` slots from
    ``host_slot``; EngineMisuse (a refused command, never a dead rank) when there is no pool or the
    slots fall outside it."""
    if pool is None:
        raise EngineMisuse("this engine has no L1 host pool")
    if num_blocks < 1:
        raise EngineMisuse(f"need at least one block, got {num_blocks}")
    if not 0 <= host_slot <= pool.num_slots - num_blocks:
        raise EngineMisuse(f"host slots [{host_slot}, {host_slot + num_blocks}) outside 0..{pool.num_slots}")
    return pool


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS emitted (the EOS token is part of the output)
    LENGTH = "length"  # max_tokens reached or max_model_len reached
    ABORT = "abort"  # abort() was called
    ERROR = "error"  # the engine could not run it (e.g. no capacity); message in ``error``


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # < 1e-5 means greedy
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None  # per-request seed; same seed + same prompt -> same tokens
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_ids: np.ndarray  # int32, 1-D, non-empty
    sampling: SamplingParams
    prefix_blocks: Sequence[BlockId] = ()
    num_cached_tokens: int = 0
    keep_blocks: bool = True
    # An L1 import the rank runs just before it applies this request (``FoldedImport``); the
    # engines never see it: the rank has applied it to ``prefix_blocks`` by then.
    fold: FoldedImport | None = None


@dataclass(slots=True, eq=False)
class FoldedImport:
    """An L1 import carried by the ``add`` it serves, so that a small restore costs no round trip
    of its own (``rank/transfers.py``, "Folded imports").

    The rank imports ``num_blocks`` host slots from ``host_slot`` into free blocks and appends them
    to the request's ``prefix_blocks`` (whose ``num_cached_tokens`` already counts them), then
    applies the add. If the import fails, the add keeps ``prefix_blocks[:fallback_blocks]`` with
    ``fallback_tokens`` cached and computes the rest: it never reads a block nobody filled.
    ``reply`` (made by the caller) gets the imported ids, on which the caller owns one cache ref
    each as after ``import_blocks``, or the failure. Over a rank process the reply leaves the rank
    before any step output of the request, on the same socket. ``sent``: the add left (set by
    the group); a fold never sent imports nothing."""

    host_slot: HostSlot
    num_blocks: int
    fallback_blocks: int
    fallback_tokens: int
    reply: asyncio.Future[list[BlockId]] = field(repr=False)
    sent: bool = False


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (``token_ids`` may be empty on a terminal abort)."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kept_blocks: list[BlockId] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_blocks: int  # including scratch block 0
    num_free_blocks: int
    num_cached_blocks: int  # blocks holding a cache ref
    num_running: int
    num_waiting: int
    running_tokens: int  # context tokens of running sequences
    waiting_tokens: int  # prompt tokens still to prefill
    num_cached_tokens_total: int  # prompt tokens served from prefix blocks since start
    num_prompt_tokens_total: int
    num_vote_fillers_total: int = 0  # DeepInfer: one-token requests rank/vote_filler.py queued


def usable_prefix_blocks(num_matched_blocks: int, prompt_len: int, block_size: int) -> int:
    """How many of the leading matched blocks a request may start from.

    The last matched block is replayed (DeepInfer's prefix-cache patch recomputes it to rebuild
    the sliding-window state), and at least one prompt token must be left to compute.
    """
    if num_matched_blocks <= 1 or prompt_len <= 1:
        return 0
    return max(0, min(num_matched_blocks - 1, (prompt_len - 1) // block_size))


class Engine(abc.ABC):
    """One rank's engine. Not thread-safe: the rank loop calls it from one thread (except the
    transfers of an engine that declares ``concurrent_transfers``).

    The attributes below are what the rank loop (rank/rank_loop.py) and the in-process group
    (rank/local_group.py) read; the class-level values are the defaults an engine overrides.
    """

    block_size: int
    num_blocks: int  # including scratch block 0
    bytes_per_block: int = 0  # bytes of one KV block row (= one L1 host slot); 0: no host tier
    # True when the engine runs the ranks' lockstep itself (DeepInfer: its own torch.distributed
    # group and per-step collectives); the worker then builds only a side group for its votes.
    owns_lockstep: bool = False
    # False when prefix blocks cannot be used (e.g. DeepInfer without our patch): ``add`` then
    # rejects ``prefix_blocks`` and nothing is kept; ``prefix_cache_reason`` says why (or, when
    # supported, what enabled it) for the operator.
    prefix_cache_supported: bool = True
    prefix_cache_reason: str | None = None
    # Set by the lockstep worker for engines that do not own the lockstep: a collective the
    # engine calls once per (placeholder) step, as a real model's forward would. Others ignore it.
    step_collective: Callable[[], None] | None = None
    # Set by the lockstep worker for engines that own the lockstep: an all_reduce MIN of a few ints
    # over the ranks' side group. Every rank must call it at the same point of the same iteration.
    group_min: Callable[[list[int]], list[int]] | None = None
    # Engines that own the lockstep: whether any rank had work at the last ``lockstep_has_work``
    # vote (the worker runs its idle-time shutdown vote only when no rank had).
    group_had_work: bool = False
    # True when ``import_blocks``/``export_blocks``/``release`` (and ``transfer_stats``) may run on a
    # second thread while ``step`` runs, so the worker's transfer thread (rank/transfers.py)
    # overlaps L1 restores and writes with the step in progress (both real engines:
    # rank/pool_transfers.py, rank/deepinfer_transfers.py). False: every call comes from the loop
    # thread, between steps.
    concurrent_transfers: bool = False

    @abc.abstractmethod
    def add(self, request: EngineRequest) -> None:
        """Queue a request. Raises EngineMisuse (nothing changed) on a contract violation."""

    @abc.abstractmethod
    def step(self) -> list[RequestOutput]:
        """Run one engine step (prefill chunk or decode) and return its outputs."""

    @abc.abstractmethod
    def placeholder_step(self) -> None:
        """Run the idle step a lockstep rank runs when a peer has work and it has none."""

    @abc.abstractmethod
    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests; their terminal outputs (finish_reason ABORT) come from the next step."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """True while any request is waiting, running, or owes a terminal output."""

    @abc.abstractmethod
    def release(self, block_ids: Sequence[BlockId]) -> None:
        """Drop one cache ref on each block (validated first: in range and cache-held)."""

    @abc.abstractmethod
    def export_blocks(self, block_ids: Sequence[BlockId], host_slot: HostSlot,
                      between: Callable[[], None] | None = None) -> None:
        """Copy blocks into consecutive L1 host slots starting at ``host_slot``. An engine that
        copies in parts (``concurrent_transfers``) calls ``between`` after each part but the
        last, with the blocks still pinned: the transfer thread runs the commands that came
        meanwhile, so a restore does not wait for a long write (``rank/transfers.py``). Others
        may ignore it. (DeepInfer exports cache-held blocks only: what the cache ever exports.)"""

    @abc.abstractmethod
    def import_blocks(self, host_slot: HostSlot, num_blocks: int) -> list[BlockId]:
        """Allocate ``num_blocks`` fresh blocks (cache refs) and fill them from host slots."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """Current counters (cheap; called every step)."""

    @abc.abstractmethod
    def check_accounting(self) -> None:
        """Raise AssertionError if block bookkeeping is inconsistent (tests call it)."""

    def transfer_stats(self, last: EngineStats) -> EngineStats:
        """``concurrent_transfers`` engines: ``last`` (the loop thread's latest ``stats()``) with
        the block counts as they are now; safe to call from the transfer thread."""
        return last

    def lockstep_has_work(self) -> bool:
        """Engines that own the lockstep: the per-iteration collective vote, on every rank,
        before ``step`` (sets ``group_had_work``); True when this rank must step. Others are
        never asked (the worker runs its own vote)."""
        raise NotImplementedError(f"{type(self).__name__} does not own the lockstep")

    def close(self) -> None:  # an optional hook: engines with nothing to close keep this one
        """Free resources (GPU memory, host mappings)."""
