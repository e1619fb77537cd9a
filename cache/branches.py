"""Branches of a session and prefixes held elsewhere: the manager's side of the routing rules
for subagents, new sessions sharing a prefix with another rank, and compaction.

* ``copy_prefix``: rule 3 chose a rank that lacks the prompt's prefix another rank holds
  (``RouteDecision.copy_from``, ``cache/router.py``); the chain goes from there to L1 as the
  start of the new session's (or branch's) L1 entry, and the turn's admission restores it
  (``cache/planner.py`` counts L1 blocks as restorable). While the copy runs, the turn's tokens
  count as waiting on its rank (``placing``), so turns arriving meanwhile do not all choose it.
  Branches that route while a copy of the same chain is in flight (four subagents starting at
  once, all lacking their shared prefix off the parent's rank) join that copy instead of making
  their own: L1 then holds the chain once, and each admission restores it from there.
* ``retire``: a compaction replaced a session's prefix; its first turn on the new prefix (told
  by the compaction headers, or by its prompt: ``prefix_broken``) makes the old chain's blocks
  ownerless, so eviction takes them first (``cache/eviction.py``), while the blocks the new
  prompt shares (system prompt, tools) stay. Until that turn arrives the old prefix is kept as
  any idle session's (the summary request itself runs on it).
* ``continues``: whether a prompt holds a session's whole first prompt where it lives
  (``SessionTable.resolve`` tells a re-rendered main-thread turn from a fresh branch with it).
"""

from __future__ import annotations

import asyncio
import logging

from cache.hashing import BlockHash
from cache.l1_writes import L1Writes
from cache.planner import known_prefix_blocks
from cache.router import RouteDecision
from cache.sessions import RequestClass, Session
from cache.state import CacheState

log = logging.getLogger(__name__)


class Branches:
    """See the module docstring. One event loop."""

    def __init__(self, state: CacheState, writes: L1Writes) -> None:
        self._s = state
        self._writes = writes
        self.placing = [0] * state.client.num_ranks  # prompt tokens of turns copying a prefix, per rank
        # Copies to L1 in flight, by the last hash of the chain they copy (joined, not repeated).
        self._copies: dict[BlockHash, asyncio.Task[bool]] = {}

    async def copy_prefix(self, session: Session, decision: RouteDecision, hashes: list[BlockHash],
                          num_tokens: int) -> bool:
        """Copy ``hashes[:decision.copy_blocks]`` from ``decision.copy_from`` to L1 under the
        session's id, or wait for a copy of the same chain already in flight (``joined``). A
        failed copy only costs the prefill it meant to save."""
        s = self._s
        assert decision.copy_from is not None and decision.copy_blocks > 0
        dst = decision.rank
        chain = hashes[: decision.copy_blocks]
        task = self._copies.get(chain[-1])
        joined = task is not None
        if task is None:
            # A task of its own: a caller cancelled while it runs leaves it to its joiners.
            task = s.tasks.spawn(self._writes.write_through(decision.copy_from, session.session_id, chain,
                                                            s.epoch))
            self._copies[chain[-1]] = task
            task.add_done_callback(lambda done: self._copy_done(chain[-1], done))
        self.placing[dst] += num_tokens
        try:
            ok = await asyncio.shield(task)
        finally:
            self.placing[dst] -= num_tokens
        outcome = "joined" if joined and ok else "copied" if ok else "failed"
        log.info("prefix of %s: %d blocks from rank %d to rank %d through L1 (%s)", session.session_id,
                 decision.copy_blocks, decision.copy_from, dst, outcome)
        if s.metrics is not None:
            s.metrics.prefix_copies.labels(outcome).inc()
        return ok

    def _copy_done(self, tail: BlockHash, task: asyncio.Task[bool]) -> None:
        if self._copies.get(tail) is task:
            del self._copies[tail]

    def continues(self, session: Session, hashes: list[BlockHash]) -> bool:
        """The prompt named ``hashes`` holds all of the session's first prompt (its full blocks)
        on the session's home rank."""
        rank = session.home_rank
        first_blocks = session.first_prompt_tokens // self._s.block_size
        return rank is not None and first_blocks > 0 and self._s.l0[rank].match(hashes) >= first_blocks

    def prefix_broken(self, session: Session, hashes: list[BlockHash]) -> bool:
        """A main session's turn on a new prefix (a compaction's first turn, seen by its
        prompt): nothing of the session in flight, the prompt extends none of its tails, yet it
        holds at least half of the session's first prompt where the session lives (the system
        prompt and tools: a one-off side request with another system prompt does not)."""
        rank = session.home_rank
        if (session.request_class is not RequestClass.MAIN or rank is None or session.num_in_flight
                or not session.tail_hashes or not session.first_prompt_tokens
                or known_prefix_blocks(session.tail_hashes, hashes)):
            return False
        return 2 * self._s.l0[rank].match(hashes) * self._s.block_size >= session.first_prompt_tokens

    def retire(self, session: Session, tails: list[BlockHash], hashes: list[BlockHash]) -> int:
        """The chains ending at ``tails`` are dead for ``session``: their blocks the new prompt
        (``hashes``) does not share lose their owner on every rank. Returns how many."""
        keep = set(hashes)
        num = sum(idx.disown(tail, session.session_id, keep) for idx in self._s.l0.ranks for tail in tails)
        log.info("session %s compacted: %d blocks of its old prefix go first", session.session_id, num)
        self._s.on_change()
        return num
