"""A small L1 restore folded into its turn's add (``L1Restores.fold``): no round trip of its own,
and nothing leaks whatever comes first ("a dead rank, a dropped client or a full KV pool leaks
nothing", as for the awaited restore in test_cache_restore_races.py).

The rank's side is the in-process group's (``LocalRankGroup`` runs the import just before the
add, as a rank process does); ``HeldFold`` holds the fold's reply until the test lets it land (or
fails it, as ``RankMessenger.fail_all`` does at a restart), so each race is replayed exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from cache.manager import CacheManager
from cache.sessions import SessionId, StopKind
from cache.turns import Tier
from rank.client import RequestStream
from rank.engine import CapacityExhausted, EngineRequest, SamplingParams
from rank.errors import RankFailed
from rank.ids import BlockId, Rank
from rank.local_group import LocalRankGroup
from tests.cache.cache_harness import (
    BLOCK_SIZE,
    make_group,
    make_manager,
    next_prompt,
    run_turn,
    settle,
    tokens,
)

pytestmark = pytest.mark.timeout(120)


class Adds:
    """Wraps rank 0's ``engine.add``: the requests as the engine got them (the fold applied)."""

    def __init__(self, group: LocalRankGroup) -> None:
        engine = group.engines[0]
        self.real = engine.add
        self.requests: list[EngineRequest] = []
        engine.add = self  # type: ignore[method-assign]

    def __call__(self, request: EngineRequest) -> None:
        self.requests.append(request)
        self.real(request)


class HeldFold:
    """Wraps ``group.submit``: the rank imports and adds at once, the fold's reply is held until
    ``land`` (or ``fail``)."""

    def __init__(self, group: LocalRankGroup) -> None:
        self.group = group
        self.real = group.submit
        self.sent = asyncio.Event()
        self.outer: asyncio.Future[list[BlockId]] | None = None
        self.inner: asyncio.Future[list[BlockId]] | None = None
        self.stream: RequestStream | None = None
        group.submit = self  # type: ignore[method-assign]

    def __call__(self, rank: Rank, request: EngineRequest) -> RequestStream:
        fold = request.fold
        assert fold is not None, "the restore was not folded"
        self.outer = fold.reply
        fold.reply = self.inner = asyncio.get_running_loop().create_future()
        self.stream = self.real(rank, request)
        self.sent.set()
        return self.stream

    @property
    def imported(self) -> list[BlockId]:
        assert self.inner is not None
        return self.inner.result()

    def land(self) -> None:
        assert self.outer is not None and self.inner is not None
        self.outer.set_result(self.inner.result())

    def fail(self, exc: BaseException) -> None:
        assert self.outer is not None
        self.outer.set_exception(exc)

    def restore(self) -> None:
        self.group.submit = self.real  # type: ignore[method-assign]


@contextlib.contextmanager
def _imports_fail(group: LocalRankGroup) -> Iterator[None]:
    """Rank 0's imports fail as on a pool with no free block, until the block ends."""
    engine = group.engines[0]
    real = engine.import_blocks

    def short(*_: Any) -> list[BlockId]:
        raise CapacityExhausted("import: 0 free")

    engine.import_blocks = short  # type: ignore[method-assign]
    try:
        yield
    finally:
        engine.import_blocks = real  # type: ignore[method-assign]


def _no_round_trip(group: LocalRankGroup) -> None:
    async def import_blocks(*_: Any) -> list[BlockId]:
        raise AssertionError("a small restore made an import round trip")

    group.import_blocks = import_blocks  # type: ignore[method-assign]


async def _session_in_l1(mgr: CacheManager, group: LocalRankGroup, rng: np.random.Generator,
                         head: np.ndarray) -> np.ndarray:
    """Session "a"'s next prompt, whose chain L1 holds while the GPU holds only ``head`` (shared
    with session "b", whose longer turn pushed a's own blocks out of the GPU)."""
    first = await run_turn(mgr, group, np.concatenate([head, tokens(rng, 100)]), "a", stop=StopKind.END_TURN)
    await mgr.drain()
    await run_turn(mgr, group, np.concatenate([head, tokens(rng, 300)]), "b", stop=StopKind.END_TURN)
    await mgr.drain()
    assert mgr.l1.backed_blocks(first.admission.session_id) > 0
    return next_prompt(first, tokens(rng, 20))


async def _setup(seed: int) -> tuple[LocalRankGroup, CacheManager, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    group = await make_group("null", num_blocks=26, num_ranks=1, host_slots=64)
    mgr, _ = make_manager(group, l1_write_watermark=0.0, protect_s=0.0)
    head = tokens(rng, 32)
    return group, mgr, head, await _session_in_l1(mgr, group, rng, head)


def test_a_folded_restore_reaches_the_engine_as_the_adds_prefix_without_a_round_trip() -> None:
    async def main() -> None:
        group, mgr, head, a2 = await _setup(21)
        try:
            hashes = mgr.hasher.hashes(a2)
            num_l0 = mgr.l0[0].match(hashes)
            assert num_l0 == len(head) // BLOCK_SIZE  # the shared head only: the rest is in L1
            real_import = group.import_blocks
            _no_round_trip(group)
            adds = Adds(group)
            turn = await run_turn(mgr, group, a2, "a")
            group.import_blocks = real_import  # type: ignore[method-assign]
            request = adds.requests[-1]
            restored = turn.admission.cached_tokens_by_tier[Tier.L1] // BLOCK_SIZE
            assert restored > 0 and request.fold is None  # applied before the engine saw it
            assert len(request.prefix_blocks) == num_l0 + restored
            assert request.num_cached_tokens == BLOCK_SIZE * len(request.prefix_blocks)
            assert turn.admission.num_cached_tokens == request.num_cached_tokens
            # the restored blocks are filed where the chain says
            assert mgr.l0[0].block_ids(hashes[: num_l0 + restored]) == list(request.prefix_blocks)
            await settle(mgr, group)  # engine cache-held blocks == L0 index, refs balanced
            nxt = await run_turn(mgr, group, next_prompt(turn, tokens(np.random.default_rng(1), 20)), "a")
            assert nxt.admission.cached_tokens_by_tier[Tier.L0] >= request.num_cached_tokens
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_a_folded_restore_whose_import_fails_lowers_the_cached_prefix_and_the_turn_computes_it() -> None:
    async def main() -> None:
        group, mgr, head, a2 = await _setup(22)
        try:
            adds = Adds(group)
            with _imports_fail(group):
                turn = await run_turn(mgr, group, a2, "a")
            request = adds.requests[-1]
            # the head's blocks but its last, now the replayed one (as for a failed awaited restore)
            num_kept = len(head) // BLOCK_SIZE - 1
            assert len(request.prefix_blocks) == num_kept
            assert request.num_cached_tokens == BLOCK_SIZE * num_kept
            assert turn.output_ids and len(turn.output_ids) == 8
            await settle(mgr, group)
            await run_turn(mgr, group, a2, "a")  # and the next turn works from what it computed
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_the_cached_count_a_client_is_told_is_the_one_after_a_failed_fold() -> None:
    """The service builds usage from ``turn.admission`` after ``settle_fold``: a fold that fails
    after the turn started must not be reported as cached (the rank computed that part)."""
    async def main() -> None:
        group, mgr, head, a2 = await _setup(22)
        try:
            with _imports_fail(group):
                async with mgr.turn(a2, "a", 8) as turn:
                    planned = turn.admission.num_cached_tokens
                    assert turn.admission.cached_tokens_by_tier[Tier.L1] > 0  # the plan: an L1 restore
                    stream = group.submit(turn.rank, turn.engine_request("r-fold", SamplingParams(
                        max_tokens=8, ignore_eos=True)))
                    await asyncio.sleep(0)  # the failed reply is filed by the cache ...
                    assert turn.admission.num_cached_tokens == planned  # ... but the view is the plan's
                    await turn.settle_fold()
                    num_kept = len(head) // BLOCK_SIZE - 1
                    assert turn.admission.num_cached_tokens == BLOCK_SIZE * num_kept < planned
                    assert turn.admission.cached_tokens_by_tier[Tier.L1] == 0
                    async for out in stream:
                        turn.feed(out)
                    turn.stop_kind = StopKind.END_TURN
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_a_turn_cancelled_while_its_folded_restore_is_in_flight_releases_the_imported_blocks() -> None:
    async def main() -> None:
        group, mgr, _, a2 = await _setup(23)
        held = HeldFold(group)
        try:
            task = asyncio.get_running_loop().create_task(run_turn(mgr, group, a2, "a", max_tokens=64))
            await asyncio.wait_for(held.sent.wait(), 5.0)
            assert held.imported  # the rank holds them for the cache from now on
            task.cancel()  # the client went away before the reply came
            with pytest.raises(asyncio.CancelledError):
                await task
            assert held.stream is not None
            held.stream.abort()
            assert mgr.num_open_turns == 0
            # Until the reply lands the blocks are held by the rank but not filed: they count as
            # releasing, so no planner counts them free.
            assert mgr.state.releases.pending(0) == len(held.imported)
            held.land()
            held.restore()
            await asyncio.sleep(0)  # the reply's callback runs (as after the messenger settles it)
            await settle(mgr, group)
            assert not set(held.imported) & {n.block_id for n in mgr.l0[0].nodes.values()}
            await run_turn(mgr, group, a2, "a")  # the next turn restores the chain again
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_a_turn_closed_before_its_add_was_sent_leaves_nothing_held() -> None:
    async def main() -> None:
        group, mgr, _, a2 = await _setup(24)
        try:
            adm = await mgr.admit(a2, "a", 8)
            assert adm.fold is not None and not adm.fold.sent
            mgr.abort(adm)  # e.g. the service failed before it submitted the turn
            assert adm.fold.reply.cancelled()
            await settle(mgr, group)  # no L1 entry held, no block reserved or pinned
            await run_turn(mgr, group, a2, "a")
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_a_restart_while_a_folded_restore_is_in_flight_leaves_the_new_epoch_untouched() -> None:
    async def main() -> None:
        group, mgr, _, a2 = await _setup(25)
        held = HeldFold(group)
        try:
            task = asyncio.get_running_loop().create_task(run_turn(mgr, group, a2, "a", max_tokens=64))
            await asyncio.wait_for(held.sent.wait(), 5.0)
            old_epoch = mgr.epoch
            await group.restart("test: a rank died")
            assert mgr.epoch != old_epoch
            held.fail(RankFailed(f"rank group epoch {old_epoch} failed: restarted"))
            held.restore()
            with pytest.raises(RankFailed):
                await task
            ledger = mgr.state.ledgers[0]
            assert (ledger.reserved_blocks, ledger.running_tokens, ledger.num_open) == (0, 0, 0)
            assert mgr.num_open_turns == 0
            session = mgr.sessions.get(SessionId("hint:a"))
            assert session is not None and session.num_in_flight == 0
            await settle(mgr, group)
            await run_turn(mgr, group, a2, "a")  # the session's next turn runs in the new epoch
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())
