"""The rank supervisor must not mistake a blocked backend event loop for stalled ranks.

Suspected after the soak on an overloaded machine declared a rank stalled (no heartbeat for
4.8 s) and restarted the group: if the backend's loop does not run, the heartbeats of healthy
ranks wait unread in their sockets. This test shows the supervisor copes (the receivers run
before the watchdog once the loop resumes), so that restart had another cause (a starved rank
process). Here the loop is blocked on purpose (a synchronous sleep, like tokenizing a huge
prompt on the loop) for longer than the heartbeat limit; the group must stay READY in the same
epoch. A real stall (SIGSTOP) is still
detected: tests/reliability/test_reliability_rank_failure.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from rank.client import GroupState
from server.config import load_config


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_blocked_backend_loop_is_not_a_rank_stall() -> None:
    from rank.group import RankGroup

    config = load_config({"engine": "reference", "reference_model": "null", "ep": 2, "block_size": 16,
                          "reference_num_blocks": 64, "l1_cache": False, "max_model_len": 1024})

    async def run() -> tuple[int, int, str, str | None]:
        group = RankGroup(config.rank_config(), heartbeat_timeout_s=3.0)
        await group.start()
        try:
            epoch = group.epoch
            time.sleep(group.heartbeat_timeout_s + 1.5)  # the loop is blocked; the ranks are fine
            await asyncio.sleep(2.0)  # let the watchdog and the receivers run
            return epoch, group.epoch, group.state.value, group.last_failure
        finally:
            await group.close()

    epoch_before, epoch_after, state, failure = asyncio.run(run())
    assert (epoch_after, state) == (epoch_before, GroupState.READY.value), failure
