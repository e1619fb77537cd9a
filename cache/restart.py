"""The rank group's lifecycle as the cache sees it: restarts, the host pool, L1 on or off.

* **Restart** (``RestartSync.on_restart``, a restart listener on the ``RankClient``): a new epoch
  means every GPU block id of the old one is gone, so every L0 entry is dropped, the ledgers
  start over, and admissions of the old epoch are closed without touching the new engines
  (``CacheManager`` checks the epoch). L1's committed entries are kept: the host pool outlives
  the ranks (``CacheState.reset``), so a session's next turn restores from L1.
* **Host pool** (``sync_l1``): the pool is allocated without blocking startup, so L1 turns on
  when the group reports host slots (checked at every admission until then).
* **Unsupported** (``disable_l1_if_unsupported``): an engine that cannot copy blocks to or from
  the host turns L1 off for good (until the next restart).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cache.state import CacheState
from rank.engine import CapacityExhausted, EngineMisuse
from rank.errors import RankFailed, RankUnavailable
from rank.ids import Epoch

log = logging.getLogger("cache.manager")

RANK_ERRORS = (RankFailed, RankUnavailable, CapacityExhausted, EngineMisuse, NotImplementedError)
_DISABLED = "disabled:"


def sync_l1(state: CacheState) -> None:
    """Adopt the host pool once it exists (it is allocated without blocking startup)."""
    if state.l1_off_reason is None or state.l1_off_reason.startswith(_DISABLED):
        return
    slots = state.client.num_host_slots
    if not state.config.l1_cache:
        reason = "l1_cache is false"
    elif not state.config.prefix_cache:
        reason = "prefix_cache is false"
    elif slots <= 0:
        reason = "the rank group has no L1 host pool (yet)"
    else:
        state.l1_on(slots, state.client.bytes_per_block)
        log.info("L1 on: %d host slots of %d B", slots, state.client.bytes_per_block)
        return
    if reason != state.l1_off_reason:
        log.info("L1 off: %s", reason)
        state.l1_off(reason)


def disable_l1_if_unsupported(state: CacheState, exc: BaseException) -> None:
    """Turn L1 off when a transfer failed because the engine cannot do it at all."""
    text = str(exc)
    if isinstance(exc, NotImplementedError) or "no L1 host pool" in text:
        state.l1_off(f"{_DISABLED} the engine cannot copy blocks to/from host ({text})")
        log.warning("L1 off: %s", state.l1_off_reason)


class RestartSync:
    """Resets the cache's parts when the rank group restarts (see the module docstring)."""

    def __init__(self, state: CacheState, *resets: Callable[[], None]) -> None:
        self._state = state
        self._resets = resets  # the parts' own per-epoch state (prefetches, ...)

    def on_restart(self, new_epoch: Epoch) -> None:
        state = self._state
        old_epoch = state.epoch
        kept = state.reset(new_epoch)
        log.warning("rank group restarted (epoch %d -> %d): dropped every L0 entry, kept %d L1 entries",
                    old_epoch, new_epoch, kept)
        for reset in self._resets:
            reset()
        state.l1_off("not started")
        sync_l1(state)
        state.queue.notify_all()
