"""Engine 'deepinfer' in a real rank process: L1 transfers on the worker's transfer thread.

Over the CI stand-in (``standins.fake_deepinfer_lockstep``, as in test_rank_deepinfer_processes.py).
The test gate (``DIB_TEST_TRANSFER_GATE``) holds the loop thread before ``step`` for as long as
a file exists, so the order is asserted without a clock: a restore and writes reply while the
step is held (before this change DeepInfer's transfers ran on the loop thread, between steps,
and waited for the step); a release of a block that a queued add names waits for that add; the
restored prefix gives the same tokens as the same prompt computed cold.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from rank.engine import usable_prefix_blocks
from rank.group import RankGroup
from rank.rank_setup import TEST_ENGINE_WRAPPER_ENV
from rank.transfers import ENABLE_ENV, GATE_ENV
from tests.rank.rank_stream_helpers import collect
from tests.rank.test_rank_deepinfer_processes import BS, _config, _ids, _request, _wait_all_free
from tests.rank.test_rank_transfer_thread import WAIT_S, _slots, _until


def _group(gate: Path, thread: bool = True) -> RankGroup:
    env = {**os.environ, GATE_ENV: str(gate), TEST_ENGINE_WRAPPER_ENV: "standins.step_gate",
           ENABLE_ENV: "1" if thread else "0"}
    return RankGroup(_config(patched=True, ep=1).rank_config(), python=sys.executable, base_env=env)


@pytest.mark.timeout(240)
def test_restores_reply_while_deepinfer_steps_and_keep_their_order(tmp_path: Path) -> None:
    async def scenario() -> None:
        group = _group(tmp_path)
        await group.start()
        try:
            ids = _ids(3 * BS + 20, seed=1)
            tokens, last = await asyncio.wait_for(collect(group.submit(0, _request("a", ids, 3))), WAIT_S)
            kept = list(last.kept_blocks)
            assert len(kept) == 3
            await asyncio.wait_for(group.export_blocks(0, kept, 0), WAIT_S)
            await group.release(0, kept)  # the session spilled to L1
            await _wait_all_free(group)

            (tmp_path / "hold-step").touch()
            await _until(tmp_path / "held-step")
            # The loop thread is held before DeepInfer's step: the restore still replies.
            restored = await asyncio.wait_for(group.import_blocks(0, 0, len(kept)), WAIT_S)
            await asyncio.wait_for(group.export_blocks(0, restored, 10), WAIT_S)
            assert _slots(group, 0, 3) == _slots(group, 10, 3)  # byte-exact through the restore
            # The next turn starts from the restored prefix; its add waits for the loop thread,
            # and a release naming its prefix block stays behind it.
            turn2 = np.concatenate([ids, np.asarray(tokens, np.int32), _ids(50, seed=2)])
            usable = usable_prefix_blocks(len(restored), turn2.size, BS)
            warm = group.submit(0, _request("warm", turn2, 5, restored[:usable]))
            release = asyncio.ensure_future(group.release(0, restored))
            await asyncio.wait_for(group.export_blocks(0, restored, 20), WAIT_S)  # replies first
            assert not release.done() and (tmp_path / "held-step").exists()
            (tmp_path / "hold-step").unlink()
            await asyncio.wait_for(release, WAIT_S)
            warm_tokens, warm_last = await asyncio.wait_for(collect(warm), WAIT_S)
            cold_tokens, _ = await asyncio.wait_for(
                collect(group.submit(0, _request("cold", turn2, 5, keep=False))), WAIT_S)
            assert warm_tokens == cold_tokens and warm_last.num_cached_tokens == BS * usable
            await group.release(0, warm_last.kept_blocks)
            await _wait_all_free(group)
        finally:
            await group.close()

    asyncio.run(scenario())


@pytest.mark.timeout(240)
def test_without_the_thread_a_restore_waits_for_the_step(tmp_path: Path) -> None:
    """``DIB_TRANSFER_THREAD=0`` (the A/B switch): the same restore waits for the held step, as
    every DeepInfer restore did before; this is what the test above rules out."""
    async def scenario() -> None:
        group = _group(tmp_path, thread=False)
        await group.start()
        try:
            ids = _ids(3 * BS + 20, seed=1)
            _, last = await asyncio.wait_for(collect(group.submit(0, _request("a", ids, 3))), WAIT_S)
            await asyncio.wait_for(group.export_blocks(0, last.kept_blocks, 0), WAIT_S)
            await group.release(0, last.kept_blocks)
            (tmp_path / "hold-step").touch()
            await _until(tmp_path / "held-step")
            restore = asyncio.ensure_future(group.import_blocks(0, 0, 3))
            await asyncio.sleep(0.5)  # (not a timing assert: the restore cannot finish while held)
            assert not restore.done()
            (tmp_path / "hold-step").unlink()
            await group.release(0, await asyncio.wait_for(restore, WAIT_S))
            await _wait_all_free(group)
        finally:
            await group.close()

    asyncio.run(scenario())
