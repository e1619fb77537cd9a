"""The rank worker's transfer thread (rank/transfers.py) in a real rank process, CPU.

The test gate (``DIB_TEST_TRANSFER_GATE``) holds a step or a transfer for as long as a file
exists, so the order of events is asserted without a clock: imports, exports and releases reply
while a step is held, and so does an import that needs the blocks of the release before it; a
release of a block that an add still queued for the loop names is applied after that add, an
import that needs such a release runs after it, and imports keep their order; a rank SIGKILLed
mid-transfer (an import or a release) fails it with RankFailed and the group serves again.
Transfers take the transfer channel (rank/transfer_channel.py): a release on it still waits for
the add numbered before it on zmq, and after the channel is lost both ways fall back to zmq; an
import sent during an export held between its parts runs before the export ends.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rank.client import RequestStream
from rank.engine import CapacityExhausted, EngineMisuse, EngineRequest, SamplingParams
from rank.errors import RankFailed
from rank.group import RankGroup
from rank.link import TransferTiming
from rank.rank_setup import TEST_ENGINE_WRAPPER_ENV
from rank.transfers import GATE_ENV
from server.config import WorkloadConfig
from tests.rank.rank_stream_helpers import collect

BLOCK = 16
WAIT_S = 60  # bounds on a hang, not timing asserts


def _group(gate: Path, **overrides: Any) -> RankGroup:
    base: dict[str, Any] = dict(reference_model="tiny", ep=1, block_size=BLOCK, reference_num_blocks=64,
                                max_num_batched_tokens=256, l1_host_gb=0.005)
    base.update(overrides)
    env = {**os.environ, GATE_ENV: str(gate), TEST_ENGINE_WRAPPER_ENV: "standins.step_gate"}
    return RankGroup(WorkloadConfig(**base).rank_config(), base_env=env)


def _request(rid: str, length: int, max_tokens: int, seed: int = 0) -> EngineRequest:
    ids = np.random.default_rng(seed).integers(3, 129_280, length).astype(np.int32)
    return EngineRequest(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _until(path: Path) -> None:
    for _ in range(WAIT_S * 100):
        if path.exists():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{path} never appeared")


async def _cached_turn(group: RankGroup) -> list[int]:
    """Run request "a" (60 prompt tokens, 3 out) to its end and wait until only its kept blocks
    are held; returns them."""
    _, first = await collect(group.submit(0, _request("a", 60, 3)))
    await _idle(group, cached=len(first.kept_blocks))
    return list(first.kept_blocks)


async def _finish(group: RankGroup, stream: RequestStream, num_tokens: int) -> None:
    """Run ``stream`` to its end, expect ``num_tokens``, give back its kept blocks and wait until
    the rank holds nothing."""
    tokens, last = await asyncio.wait_for(collect(stream), WAIT_S)
    assert len(tokens) == num_tokens
    await group.release(0, last.kept_blocks)
    await _idle(group)


async def _idle(group: RankGroup, cached: int = 0) -> None:
    for _ in range(WAIT_S * 20):
        if group.stats(0).num_free_blocks == group.num_blocks - 1 - cached:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(group.stats(0))


def _slots(group: RankGroup, first: int, n: int) -> bytes:
    with open(group.host_pool_path, "rb") as f:
        f.seek(first * group.bytes_per_block)
        return f.read(n * group.bytes_per_block)


@pytest.mark.timeout(180)
def test_transfers_reply_while_a_step_is_held_and_commands_keep_their_order(tmp_path: Path) -> None:
    async def scenario() -> None:
        group = _group(tmp_path)
        await group.start()
        try:
            kept = await _cached_turn(group)
            assert len(kept) == 3  # (60 + 3 - 1) // 16

            (tmp_path / "hold-step").touch()
            held = group.submit(0, _request("b", 12, 2, seed=1))  # 1 block, no more
            await _until(tmp_path / "held-step")
            # The loop thread is inside a step: transfers still reply.
            await asyncio.wait_for(group.export_blocks(0, kept, 0), WAIT_S)
            restored = await asyncio.wait_for(group.import_blocks(0, 0, len(kept)), WAIT_S)
            await asyncio.wait_for(group.export_blocks(0, restored, 10), WAIT_S)
            assert _slots(group, 0, 3) == _slots(group, 10, 3)  # byte-exact through a restore
            assert (tmp_path / "held-step").exists()
            # An add sent now waits for the loop thread; a release of a block it names as a
            # prefix stays on the loop thread behind it: not applied while the step is held.
            prefixed = _request("c", 30, 2, seed=2)
            prefixed.prefix_blocks, prefixed.num_cached_tokens = (restored[0],), BLOCK
            c = group.submit(0, prefixed)
            release = asyncio.ensure_future(group.release(0, restored))
            # An import that needs the queued release's blocks runs after it (the old order):
            # the export after it replies first (the thread takes commands in order).
            free = group.stats(0).num_free_blocks
            assert free == group.num_blocks - 1 - 6
            needs_release = asyncio.ensure_future(group.import_blocks(0, 0, free + 1))
            # A small import after it would fit now, but it stays behind the big one.
            small = asyncio.ensure_future(group.import_blocks(0, 0, 1))
            await asyncio.wait_for(group.export_blocks(0, kept, 20), WAIT_S)
            assert not release.done() and not needs_release.done() and not small.done()
            (tmp_path / "hold-step").unlink()
            await asyncio.wait_for(release, WAIT_S)
            # The held step admitted b (1 block); at the boundary after it, c took its prefix
            # ref first, so the release freed restored[1:] only: free - 1 + 2 for the import.
            big = await asyncio.wait_for(needs_release, WAIT_S)
            assert len(big) == free + 1
            with pytest.raises(CapacityExhausted):  # in order: the big one left nothing
                await asyncio.wait_for(small, WAIT_S)
            await group.release(0, big)  # c waits for a block until now
            tokens, last = await asyncio.wait_for(collect(held), WAIT_S)
            assert len(tokens) == 2
            c_tokens, c_last = await asyncio.wait_for(collect(c), WAIT_S)
            assert len(c_tokens) == 2 and c_last.error is None  # its prefix block was still held
            await group.release(0, last.kept_blocks)
            await group.release(0, c_last.kept_blocks)  # restored[0] among them
            # Refused transfers leave nothing behind.
            with pytest.raises(CapacityExhausted):
                await group.import_blocks(0, 0, group.num_blocks)
            with pytest.raises(EngineMisuse):
                await group.import_blocks(0, group.num_host_slots, 1)
            await group.release(0, kept)
            with pytest.raises(EngineMisuse):
                await group.export_blocks(0, kept, 0)  # free blocks now
            await _idle(group)
        finally:
            await group.close()

    asyncio.run(scenario())


@pytest.mark.timeout(180)
def test_a_release_and_the_import_that_needs_its_blocks_reply_while_a_step_is_held(tmp_path: Path) -> None:
    """No add waits for the loop: the release runs on the transfer thread, so the import the
    cache sends right behind it (``Retirer.retire``) finds the blocks free at once."""
    async def scenario() -> None:
        group = _group(tmp_path)
        await group.start()
        try:
            kept = await _cached_turn(group)
            await group.export_blocks(0, kept, 0)
            (tmp_path / "hold-step").touch()
            held = group.submit(0, _request("b", 20, 2, seed=1))  # applied; its step is held
            await _until(tmp_path / "held-step")
            await asyncio.wait_for(group.export_blocks(0, kept, 5), WAIT_S)  # (fresh counts)
            free = group.stats(0).num_free_blocks
            group.abort(0, "none")  # queued for the loop; a release does not wait for an abort
            release = asyncio.ensure_future(group.release(0, kept))
            needs_release = asyncio.ensure_future(group.import_blocks(0, 0, free + len(kept)))
            await asyncio.wait_for(release, WAIT_S)
            restored = await asyncio.wait_for(needs_release, WAIT_S)
            assert (tmp_path / "held-step").exists()  # both replied with the step still held
            assert len(restored) == free + len(kept) == group.num_blocks - 1
            assert group.stats(0).num_free_blocks == 0
            (tmp_path / "hold-step").unlink()
            await group.release(0, restored)  # b waits for blocks until now
            await _finish(group, held, 2)
        finally:
            await group.close()

    asyncio.run(scenario())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("op", ["import", "release"])
def test_rank_sigkill_during_a_transfer_fails_it_and_the_group_serves_again(tmp_path: Path, op: str) -> None:
    async def scenario() -> None:
        group = _group(tmp_path)
        await group.start()
        try:
            _, first = await collect(group.submit(0, _request("a", 40, 2)))
            await group.export_blocks(0, first.kept_blocks, 0)
            (tmp_path / "hold-transfer").touch()
            held: asyncio.Future[Any] = asyncio.ensure_future(
                group.import_blocks(0, 0, 2) if op == "import" else group.release(0, first.kept_blocks))
            await _until(tmp_path / "held-transfer")
            os.kill(group.pids()[0], signal.SIGKILL)
            with pytest.raises(RankFailed):
                await asyncio.wait_for(held, WAIT_S)
            (tmp_path / "hold-transfer").unlink()
            await group.wait_ready(120)
            assert group.epoch == 2 and not group.messages.num_pending
            # The L1 slots outlive the rank: the new epoch restores them.
            restored = await asyncio.wait_for(group.import_blocks(0, 0, 2), WAIT_S)
            await group.release(0, restored)
            await _finish(group, group.submit(0, _request("c", 30, 3)), 3)
        finally:
            await group.close()

    asyncio.run(scenario())


@pytest.mark.timeout(180)
def test_round_trips_are_split_by_phase_and_a_held_transfer_counts_as_waiting(tmp_path: Path) -> None:
    """``RankGroup.transfer_log``: each reply's phases come from the rank's own clock between the
    backend's, so they are causal bounds, not timings: every phase is >= 0, they add up to no more
    than the awaited round trip, and a transfer held at the gate (after the rank took it, before
    the engine call) is charged to ``wait_s`` for at least as long as the test saw it held."""
    import time

    async def scenario() -> None:
        group = _group(tmp_path)
        await group.start()
        try:
            kept = await _cached_turn(group)
            t0 = time.monotonic()
            await asyncio.wait_for(group.export_blocks(0, kept, 0), WAIT_S)
            round_trip = time.monotonic() - t0
            export = group.transfer_log[-1]
            assert export.op == "export" and export.rank == 0
            phases = (export.to_rank_s, export.wait_s, export.engine_s, export.back_s, export.resume_s)
            assert min(phases) >= 0 and export.total_s <= round_trip

            (tmp_path / "hold-transfer").touch()
            restore = asyncio.ensure_future(group.import_blocks(0, 0, len(kept)))
            await _until(tmp_path / "held-transfer")
            seen_held = time.monotonic()
            await asyncio.sleep(0.2)
            released = time.monotonic()
            (tmp_path / "hold-transfer").unlink()
            restored = await asyncio.wait_for(restore, WAIT_S)
            timing = group.transfer_log[-1]
            assert timing.op == "import" and timing.wait_s >= released - seen_held
            await group.release(0, [*kept, *restored])
            assert group.transfer_log[-1].op == "release"
            await _idle(group)
        finally:
            await group.close()

    asyncio.run(scenario())


class _HeldCommands:
    """The backend's zmq command socket with its sends held while ``holding``: a command numbered
    before a transfer reaches the rank after it (the transfer takes the channel)."""

    def __init__(self, sock: Any) -> None:
        self.sock, self.holding, self.held = sock, True, []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        if self.holding:
            self.held.append((frames, flags))
        else:
            self.sock.send_multipart(frames, flags)

    def flush(self) -> None:
        self.holding = False
        for frames, flags in self.held:
            self.sock.send_multipart(frames, flags)

    def close(self, linger: int | None = None) -> None:
        self.sock.close(linger)


@pytest.mark.timeout(180)
def test_a_transfer_on_the_channel_waits_for_the_zmq_command_numbered_before_it(tmp_path: Path) -> None:
    """rank/transfer_channel.py: the channel may deliver a release before the add sent before it
    on zmq. The rank takes commands by number, so the release still waits behind that add, whose
    prefix block it names (the add takes its ref first); taken as they came, the release would
    free the block and the add would be refused. Then the backend drops the channel: transfers go
    by zmq again and still reply."""
    async def scenario() -> None:
        group = _group(tmp_path)
        await group.start()
        try:
            r = group.links[0]
            kept = await _cached_turn(group)
            assert r.channel is not None and not r.channel.closed  # the rank connected
            await group.export_blocks(0, kept, 0)
            restored = await asyncio.wait_for(group.import_blocks(0, 0, len(kept)), WAIT_S)
            held = _HeldCommands(r.cmd)
            r.cmd = held
            prefixed = _request("c", 30, 2, seed=2)
            prefixed.prefix_blocks, prefixed.num_cached_tokens = (restored[0],), BLOCK
            c = group.submit(0, prefixed)  # numbered, held here
            release = asyncio.ensure_future(group.release(0, restored))  # on the channel, next number
            await asyncio.sleep(0.5)  # room to misbehave; the rank has the release by now
            assert not release.done() and len(held.held) == 1
            held.flush()
            await asyncio.wait_for(release, WAIT_S)
            c_tokens, c_last = await asyncio.wait_for(collect(c), WAIT_S)
            assert len(c_tokens) == 2 and c_last.error is None  # its prefix block was still held
            assert restored[0] in c_last.kept_blocks
            r.cmd = held.sock
            await group.release(0, c_last.kept_blocks)
            await group.release(0, kept)
            await _idle(group)

            r.channel.close()  # lost: everything by zmq from here, both ways
            _, d = await asyncio.wait_for(collect(group.submit(0, _request("d", 40, 2, seed=3))), WAIT_S)
            n = len(d.kept_blocks)
            await asyncio.wait_for(group.export_blocks(0, d.kept_blocks, 4), WAIT_S)
            back = await asyncio.wait_for(group.import_blocks(0, 4, n), WAIT_S)
            await asyncio.wait_for(group.export_blocks(0, back, 8), WAIT_S)
            assert n and _slots(group, 4, n) == _slots(group, 8, n)  # byte-exact, by zmq
            await group.release(0, [*d.kept_blocks, *back])
            await _idle(group)
        finally:
            await group.close()

    asyncio.run(scenario())


@pytest.mark.timeout(180)
def test_an_import_sent_during_a_long_export_runs_between_its_parts(tmp_path: Path) -> None:
    """A restore does not wait for a write in progress: the export copies in parts
    (``DIB_EXPORT_PART_BYTES``: one block here) and the transfer thread runs the import that came
    meanwhile between two of them, so on the rank's clock the import ends before the export."""
    async def scenario() -> None:
        group = _group(tmp_path)
        group.processes.base_env["DIB_EXPORT_PART_BYTES"] = "1"  # one block per part
        await group.start()
        try:
            kept = await _cached_turn(group)
            await group.export_blocks(0, kept, 0)
            (tmp_path / "hold-part").touch()
            export = asyncio.ensure_future(group.export_blocks(0, kept, 10))
            await _until(tmp_path / "held-part")  # after its first part
            restore = asyncio.ensure_future(group.import_blocks(0, 0, len(kept)))
            await asyncio.sleep(0.5)  # room for the import to reach the rank
            (tmp_path / "hold-part").unlink()
            restored = await asyncio.wait_for(restore, WAIT_S)
            await asyncio.wait_for(export, WAIT_S)
            timings = {t.op: t for t in list(group.transfer_log)[-2:]}

            def done(t: TransferTiming) -> float:  # the rank's clock: when the engine call returned
                return t.sent + t.to_rank_s + t.wait_s + t.engine_s

            assert done(timings["import"]) < done(timings["export"])
            assert _slots(group, 0, len(kept)) == _slots(group, 10, len(kept))
            await group.release(0, [*kept, *restored])
            await _idle(group)
        finally:
            await group.close()

    asyncio.run(scenario())


@pytest.mark.timeout(180)
def test_a_reply_the_channel_cannot_take_goes_by_zmq_and_the_rank_serves_on(tmp_path: Path) -> None:
    """The backend drops the channel while a transfer is held on the rank: the reply's write fails,
    the thread takes the channel out of its poll and replies by zmq, and later transfers work
    in the same epoch (no restart)."""
    async def scenario() -> None:
        group = _group(tmp_path)
        await group.start()
        try:
            r = group.links[0]
            kept = await _cached_turn(group)
            assert r.channel is not None
            (tmp_path / "hold-transfer").touch()
            export = asyncio.ensure_future(group.export_blocks(0, kept, 0))
            await _until(tmp_path / "held-transfer")
            r.channel.close()
            (tmp_path / "hold-transfer").unlink()
            await asyncio.wait_for(export, WAIT_S)
            restored = await asyncio.wait_for(group.import_blocks(0, 0, len(kept)), WAIT_S)
            await asyncio.wait_for(group.export_blocks(0, restored, 10), WAIT_S)
            assert _slots(group, 0, len(kept)) == _slots(group, 10, len(kept))
            await group.release(0, [*kept, *restored])
            await _idle(group)
            assert group.epoch == 1 and group.restarts == 0
        finally:
            await group.close()

    asyncio.run(scenario())
