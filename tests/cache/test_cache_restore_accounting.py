"""The ledger never plans on blocks the engine does not have (2 x H200 run: 'L1 restore of 81
blocks on rank 1 failed: import of 81 blocks: 50 free', 58 s after a restart).

Cause found with a probe over LocalRankGroup: when a restore failed (or found its L1 entry gone),
``_restore`` still took the restored blocks out of the turn's reservation although the turn then
computes them itself, so every failed restore left a running sequence holding up to ``count``
blocks the ledger thought free, and the next restore on that rank failed too. Also, blocks whose
release was still in flight counted as free for every planner."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cache.l1_restores import FOLD_ENV
from cache.sessions import StopKind
from cache.turns import Tier
from rank.engine import CapacityExhausted, SamplingParams
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


def _ledger_free(mgr: object, rank: int) -> int:
    return mgr.loads()[rank].num_free_blocks  # type: ignore[attr-defined]


def test_failed_restore_keeps_the_blocks_the_turn_computes_reserved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FOLD_ENV, "0")  # the awaited restore; a folded one: test_cache_folded_restores

    async def main() -> None:
        rng = np.random.default_rng(3)
        a1, b1 = tokens(rng, 100), tokens(rng, 320)
        group = await make_group("null", num_blocks=24, num_ranks=1, host_slots=64)
        mgr, _ = make_manager(group, l1_write_watermark=0.0, protect_s=0.0)
        try:
            first = await run_turn(mgr, group, a1, "a", stop=StopKind.END_TURN)
            await mgr.drain()
            await run_turn(mgr, group, b1, "b", stop=StopKind.END_TURN)  # pushes a out of the GPU
            await mgr.drain()
            assert mgr.l1.backed_blocks(first.admission.session_id) > 0

            async def short_engine(rank: int, host_slot: int, num_blocks: int) -> list[int]:
                raise CapacityExhausted(f"import of {num_blocks} blocks: 0 free")

            real_import = group.import_blocks
            group.import_blocks = short_engine  # type: ignore[method-assign]
            a2 = next_prompt(first, tokens(rng, 20))
            max_tokens = 8
            adm = await mgr.admit(a2, "a", max_tokens)
            group.import_blocks = real_import  # type: ignore[method-assign]
            assert adm.cached_tokens_by_tier[Tier.L1] == 0  # fell back to computing the prefix
            total = -(-(len(a2) + max_tokens) // BLOCK_SIZE)
            assert adm.reserved_blocks == total - adm.num_used_blocks
            engine = group.engines[0]
            stream = group.submit(adm.rank, adm.engine_request("a2", a2, SamplingParams(max_tokens=max_tokens,
                                                                                       ignore_eos=True)))
            out_ids: list[int] = []
            last = None
            async for out in stream:
                # What the ledger calls free, the engine has (nothing else runs or is in flight).
                assert _ledger_free(mgr, 0) <= engine.stats().num_free_blocks
                out_ids.extend(out.token_ids)
                last = out
            assert last is not None
            mgr.finish(adm, a2, out_ids, last, StopKind.TOOL_USE)
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_blocks_whose_release_is_in_flight_are_not_free() -> None:
    async def main() -> None:
        rng = np.random.default_rng(4)
        group = await make_group("null", num_blocks=64, num_ranks=1, host_slots=0)
        mgr, _ = make_manager(group)
        gate = asyncio.Event()
        real_release = group.release

        async def slow_release(rank: int, block_ids: list[int]) -> None:
            await gate.wait()  # the rank is busy with a step: the release lands later
            await real_release(rank, block_ids)

        try:
            first = await run_turn(mgr, group, tokens(rng, 100), "a")
            await settle(mgr, group)
            group.release = slow_release  # type: ignore[method-assign]
            # The second turn starts from the first's blocks; its finish hands back duplicates
            # (the replayed last block is a fresh copy in the engine) to be released.
            await run_turn(mgr, group, next_prompt(first, tokens(rng, 40)), "a")
            engine_free = group.engines[0].stats().num_free_blocks
            assert mgr.state.releases.pending(0) > 0
            assert _ledger_free(mgr, 0) <= engine_free
            gate.set()
            await settle(mgr, group)
            assert _ledger_free(mgr, 0) == group.engines[0].stats().num_free_blocks
        finally:
            gate.set()
            await group.close()

    asyncio.run(main())


def test_restore_retries_while_the_engine_reaps_an_aborted_sequence() -> None:
    async def main() -> None:
        group = await make_group("null", num_blocks=64, num_ranks=1, host_slots=64)
        mgr, _ = make_manager(group)
        num_short = 0
        real_import = group.import_blocks

        async def briefly_short(rank: int, host_slot: int, num_blocks: int) -> list[int]:
            nonlocal num_short
            if num_short < 2:  # twice short, as while an aborted sequence awaits its reaping step
                num_short += 1
                raise CapacityExhausted(f"import of {num_blocks} blocks: 0 free")
            return await real_import(rank, host_slot, num_blocks)

        try:
            group.import_blocks = briefly_short  # type: ignore[method-assign]
            ids = await mgr.restores.import_blocks(0, 0, 3, mgr.epoch)
            assert len(ids) == 3 and num_short == 2
            await real_import_release(group, ids)
        finally:
            await group.close()

    async def real_import_release(group: object, ids: list[int]) -> None:
        await group.release(0, ids)  # type: ignore[attr-defined]
        group.check_accounting()  # type: ignore[attr-defined]

    asyncio.run(main())
