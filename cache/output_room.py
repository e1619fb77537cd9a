"""KV room for a turn's output: checked at admission, grown on demand while the reply decodes.

A running sequence holds all its blocks on its rank, so a turn's whole context (prompt + every
output token) must fit the rank's pool. Reserving ``max_tokens`` up front would starve
concurrency (Claude Code asks for 32,000 and most replies are short), so admission reserves
``min(max_tokens, output_reserve_tokens)`` and this module does the rest:

* **Admission** (``output_limit``): a turn whose ``prompt + max_tokens`` cannot fit the rank's
  usable pool even when empty is refused before its first token with the Anthropic API's
  ``input length and `max_tokens` exceed context limit: I + M > C`` (400,
  ``ContextLimitExceeded``): Claude Code retries it once with a smaller max_tokens, OpenAI SDKs
  do not retry a 400, where a 503 was retried for minutes. A max_tokens the client did not send
  (OpenAI without max_tokens: the rest of max_model_len) is trimmed to the room instead.
* **Decode** (``OutputRoom.grow``): as outputs arrive, the service reports the turn's output
  count; when fewer than ``output_lead_tokens`` of its reservation are left, the reservation
  grows by ``output_grow_tokens`` (never past max_tokens). Blocks come from the rank's free
  blocks, else idle cached blocks are evicted (sessions not about to return first, then any
  unused block: a reply in flight outranks a cached prefix, which L1 keeps when it has room),
  exported to L1 where it lacks them and released. The lead gives that release time to land
  before the engine needs the block: the engine allocates decode blocks one at a time and fails
  (reference engine) or preempts (DeepInfer, ``stop_preempted_request``) a sequence it has no
  free block for. Growth keeps cached + reserved blocks under ``usable_fraction`` like
  admission does, so DeepInfer's 0.9 prefill watermark still admits new prompts.
* **Admitted replies finish** (``RankAdmitter.admit_on``): each rank also counts its open
  turns' worst case, prompt + ``max_tokens`` in blocks (``RankLedger.worst_blocks``,
  ``cache/ledger.py``); a turn is
  admitted only while its worst case fits next to theirs in the usable pool (a prefix block
  several of them pin from L0 counted once: the engine holds it once), else it waits in the
  queue (and gets the queue's 503 before its first token if none ends in time). So running
  sequences alone never outgrow the pool, and growth always finds its blocks among free or idle
  ones (evicted to L1 where L1 lacks them). It costs concurrency only where turns ask for more
  than they use: at 14.3M tokens per rank, Claude Code's 32,000 ``max_tokens`` with a 100K prompt
  is ~110 such turns per rank. A ``max_tokens`` the client did not send counts only what
  admission reserves (``output_reserve_tokens``), so OpenAI requests without one do not each
  claim the whole context; they are the turns that can still come up short.
* If eviction cannot cover a growth anyway (only those default-``max_tokens`` turns), it is
  reserved regardless: the rank's free count goes negative, new turns queue until running ones
  end (running replies first), and the shortfall is counted (``output_room_short_blocks_total``).
  Only then can an engine still run out mid-reply.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from protocol.errors import ContextLimitExceeded

if TYPE_CHECKING:
    from cache.retire import Retirer
    from cache.state import CacheState
    from cache.turns import Admission
    from rank.ids import Rank

log = logging.getLogger(__name__)


def output_limit(num_prompt_tokens: int, max_tokens: int, room_tokens: int, is_default: bool) -> int:
    """The output tokens a turn may produce in ``room_tokens`` of KV (the rank's usable pool):
    ``max_tokens`` when it fits, the room left when ``max_tokens`` was a default, else a 400.
    The caller has checked that the prompt plus one token fits."""
    if num_prompt_tokens + max_tokens <= room_tokens:
        return max_tokens
    if is_default:
        return max(1, room_tokens - num_prompt_tokens)
    raise ContextLimitExceeded(num_prompt_tokens, max_tokens, room_tokens)


class OutputRoom:
    """Grows running turns' reservations on their rank (see the module docstring). Part of the
    ``CacheManager``: it plans on the shared ledgers and index (``cache/state.py``); one event loop."""

    def __init__(self, state: CacheState, retirer: Retirer) -> None:
        self._s = state
        self._retirer = retirer
        self.lead_tokens = state.config.output_lead_tokens
        self.grow_tokens = state.config.output_grow_tokens
        # counts the tests read (/metrics has cache.metrics' counters of the same events)
        self.num_grows = 0
        self.num_grown_blocks = 0
        self.num_evicted_blocks = 0
        self.num_short_blocks = 0

    def needs_room(self, adm: Admission, num_output_tokens: int) -> bool:
        """Cheap: is the turn within ``lead_tokens`` of the end of its reservation?"""
        room_tokens = adm.room_blocks * self._s.block_size
        return (adm.num_prompt_tokens + num_output_tokens + self.lead_tokens > room_tokens
                and room_tokens < adm.num_prompt_tokens + adm.max_output_tokens)

    def grow(self, adm: Admission, num_output_tokens: int) -> None:
        """Extend ``adm``'s reservation ahead of its decode, evicting idle blocks if needed."""
        s = self._s
        if adm.is_closed or adm.epoch != s.epoch or not self.needs_room(adm, num_output_tokens):
            return
        bs = s.block_size
        end_tokens = adm.num_prompt_tokens + adm.max_output_tokens
        target_tokens = min(end_tokens,
                            adm.num_prompt_tokens + num_output_tokens + self.lead_tokens + self.grow_tokens)
        want = -(-target_tokens // bs) - adm.room_blocks
        if want <= 0:
            return
        rank = adm.rank
        ledger = s.ledgers[rank]
        free = ledger.plannable_free_blocks()
        if want > free:
            got = self._evict(rank, want - max(0, free))
            self.num_evicted_blocks += got
            free += got
        short = max(0, want - max(0, free))
        adm.room_blocks += want
        ledger.grow(adm, want, max(0, min(end_tokens, adm.room_blocks * bs) - adm.running_tokens))
        self.num_grows += 1
        self.num_grown_blocks += want
        m = s.metrics
        if m is not None:
            m.output_room_grown_blocks.inc(want)
        if short:
            self.num_short_blocks += short
            if m is not None:
                m.output_room_short_blocks.inc(short)
            log.warning("rank %d: a reply's KV room grew by %d blocks, %d of them over the pool (running "
                        "sequences hold it; new turns wait)", rank, want, short)
        s.on_change()

    def _evict(self, rank: Rank, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` unused blocks on ``rank``: sessions not about to return
        first, then any. Each evicted chain goes to L1 where L1 lacks it, then is released (in the
        background, ``Retirer.retire``). They count as releasing until the release lands, for every
        planner but the reply that asked, as an admission's evictions do. Returns how many."""
        s = self._s
        now = s.clock()
        idx = s.l0[rank]
        got = idx.evict(num_blocks, s.policy.scorer(rank, now), s.policy.chooser(rank, now, False))
        if len(got) < num_blocks:
            got += idx.evict(num_blocks - len(got), s.policy.scorer(rank, now),
                             s.policy.chooser(rank, now, True))
        if got:
            self._retirer.retire_later(rank, got, self._retirer.evicted(rank, got))
        return len(got)
