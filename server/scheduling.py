"""What is submitted to the engine, and when: the submission gate between admission and submit.

DeepInfer takes prompts from a per-rank FIFO only at its step-type vote points, at most
``max_num_batched_tokens`` (16,384) prompt tokens per rank per prompt step, and a prompt longer
than that is chunked: its next chunk waits for the next passing vote while the turns behind it
wait too (the ``deepinfer==0.1.0`` sdist, ``docs/deepinfer.md``). Whatever order turns reach that FIFO
is the order they are prefilled in. This module decides that order; the engine stays unchanged.

Rule (``to_submit``; pure, so the service and ``bench/simulator`` run the same code):

* Per rank, the engine's queue holds at most ``engine_budget_tokens`` of prompt work (uncached
  tokens of turns submitted whose first token has not arrived): about what one prompt step can
  take, so a vote point never leaves a short turn behind a queue it cannot drain.
* Held turns go in order of ``priority``: uncached tokens minus ``aging_tokens_per_s`` times
  the seconds since the request arrived (shortest work first; a turn that has waited, in the
  admission queue or here, catches up, so nothing starves). Ties: earlier arrival, then key.
* A turn longer than the budget (a chunked prefill) goes only into an empty engine queue: at
  most one chunked prefill per rank at a time, and it never sits in front of short turns.
* Strict priority: the first turn that must wait stops the rest (no backfill past it), so an
  aged long turn is not overtaken for ever.
* Deadline: turns held ``max_hold_s`` go first, oldest first, regardless of the budget and
  of the order above (bounded added latency; the rest follow by the rule).

``SubmitGate`` applies the rule to waiting coroutines (one event loop; not thread-safe).

Off by default (``WorkloadConfig.submit_gate``): in the capacity simulator it lengthens the tail
instead of shortening it (``docs/loadtest.md``, "Moving the tail"). At 500K x 200 the pool is full
of admitted turns, and a held turn keeps its KV room reserved while it waits; and a turn released
when an earlier one's first token arrives misses the prompt step DeepInfer runs right after the
previous one (its ALL vote at decode step 0), so it waits a whole vote interval. Under cold starts
(``--arrivals steady``, 500K x 100) the p95 is the cold chunked turns themselves, which holding
the short ones back does not make faster.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field


class SchedulingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description="Off (the default, see the module docstring): every admitted "
                          "turn is submitted at once (the engine's FIFO).")
    engine_budget_tokens: int = Field(
        16_384, ge=1, description="Uncached prompt tokens per rank queued in the engine at most "
        "(DeepInfer's max_num_batched_tokens: one prompt step's worth)."
    )
    aging_tokens_per_s: float = Field(
        4096.0, ge=0, description="Priority credit per second since the request arrived (tokens)."
    )
    max_hold_s: float = Field(10.0, ge=0, description="A turn held this long is submitted regardless.")


@dataclass(frozen=True, slots=True)
class Pending:
    """A turn that is admitted (its KV room reserved, its prefix resident) and not submitted."""

    key: Hashable
    prefill_tokens: int  # prompt tokens the engine must compute (uncached)
    arrival_s: float  # when the request arrived (aging counts the admission queue too)
    held_since_s: float  # when it reached the gate (the deadline counts only this)


def priority(p: Pending, now_s: float, cfg: SchedulingConfig) -> tuple[float, float, str]:
    """Lower goes first: shortest uncached work, aged by the time since arrival."""
    return (p.prefill_tokens - cfg.aging_tokens_per_s * (now_s - p.arrival_s), p.arrival_s, str(p.key))


def submit_order(pending: Sequence[Pending], now_s: float, cfg: SchedulingConfig) -> list[Pending]:
    """Every held turn, in the order the rule would submit them."""
    return sorted(pending, key=lambda p: priority(p, now_s, cfg))


def to_submit(pending: Sequence[Pending], queued_tokens: int, now_s: float,
              cfg: SchedulingConfig) -> list[Hashable]:
    """Keys of the held turns to submit now, in order, given ``queued_tokens`` of prompt work
    already in the engine's queue on this rank (see the module docstring)."""
    if not cfg.enabled:
        return [p.key for p in sorted(pending, key=lambda p: (p.held_since_s, str(p.key)))]
    overdue = sorted((p for p in pending if now_s - p.held_since_s >= cfg.max_hold_s),
                     key=lambda p: (p.held_since_s, p.arrival_s, str(p.key)))
    out: list[Hashable] = [p.key for p in overdue]
    queued = queued_tokens + sum(p.prefill_tokens for p in overdue)
    for p in submit_order([p for p in pending if now_s - p.held_since_s < cfg.max_hold_s], now_s, cfg):
        if queued and queued + p.prefill_tokens > cfg.engine_budget_tokens:
            break  # strict priority: nothing passes the first turn that must wait
        out.append(p.key)
        queued += p.prefill_tokens
    return out


@dataclass(slots=True, eq=False)
class _Held:
    pending: Pending
    go: asyncio.Event = field(default_factory=asyncio.Event)


class SubmitGate:
    """Holds admitted turns per rank and releases them by ``to_submit``.

    ``await hold(rank, key, prefill_tokens, arrival_s)`` returns when the turn may be submitted
    (the seconds held); its prompt work then counts as queued in the engine until
    ``started(rank, key)`` (first output: its prefill is done) or ``done(rank, key)`` (ended or
    never submitted). Both are idempotent; ``done`` also drops a turn still held."""

    def __init__(self, config: SchedulingConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._held: defaultdict[int, dict[Hashable, _Held]] = defaultdict(dict)
        self._queued: defaultdict[int, dict[Hashable, int]] = defaultdict(dict)
        self.num_held = 0  # turns that waited here at all (a metric)

    def queued_tokens(self, rank: int) -> int:
        return sum(self._queued[rank].values())

    def num_waiting(self, rank: int) -> int:
        return len(self._held[rank])

    async def hold(self, rank: int, key: Hashable, prefill_tokens: int, arrival_s: float) -> float:
        now = self._clock()
        if not self.config.enabled:
            return 0.0
        held = _Held(Pending(key, max(0, prefill_tokens), arrival_s, now))
        self._held[rank][key] = held
        self._release(rank)
        if held.go.is_set():
            return 0.0
        self.num_held += 1
        try:
            while not held.go.is_set():
                left = held.pending.held_since_s + self.config.max_hold_s - self._clock()
                try:
                    await asyncio.wait_for(held.go.wait(), max(left, 0.0) + 1e-3)
                except asyncio.TimeoutError:
                    self._release(rank)  # the deadline passed: _release lets it go
        except BaseException:
            self.done(rank, key)
            raise
        return self._clock() - now

    def started(self, rank: int, key: Hashable) -> None:
        if self._queued[rank].pop(key, None) is not None:
            self._release(rank)

    def done(self, rank: int, key: Hashable) -> None:
        was_held = self._held[rank].pop(key, None) is not None
        was_queued = self._queued[rank].pop(key, None) is not None
        if was_held or was_queued:  # a dropped waiter may have been the one the rest waited for
            self._release(rank)

    def _release(self, rank: int) -> None:
        held = self._held[rank]
        if not held:
            return
        pending = [h.pending for h in held.values()]
        go = to_submit(pending, self.queued_tokens(rank), self._clock(), self.config)
        for key in go:
            h = held.pop(key)
            self._queued[rank][key] = h.pending.prefill_tokens
            h.go.set()
