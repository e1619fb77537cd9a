"""L1 write-through is incremental (2 x H200 run: 150 writes of median 148 blocks, 62 GB, for
~107 finished turns: every write re-copied the whole session because the next prompt did not
reproduce the last kept block, which holds output tokens).

Now a write copies only the blocks after the longest common prefix with what L1 holds, into the
session's one extent (cut back, then appended), and regrows geometrically: the bytes written for
an N-turn session are O(its blocks), not O(N x blocks)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from cache.hashing import BlockHash
from cache.l1_index import L1Index
from cache.sessions import SessionId, StopKind
from cache.turns import Tier
from tests.cache.cache_harness import make_group, make_manager, run_turn, settle, tokens

pytestmark = pytest.mark.timeout(180)


def _grow(chain: list[BlockHash], rng: np.random.Generator, base: int) -> list[BlockHash]:
    """The next turn's chain: the last block diverges (output not reproduced), 1-4 new blocks."""
    keep = chain[:-1] if chain else []
    return keep + [BlockHash(base + i) for i in range(int(rng.integers(2, 6)))]


def test_written_blocks_are_linear_in_the_session_not_in_turns_x_blocks() -> None:
    rng = np.random.default_rng(0)
    l1 = L1Index(100_000, headroom_fraction=0.125, min_headroom_blocks=16)
    sid = SessionId("s")
    chain: list[BlockHash] = [BlockHash(i) for i in range(1, 150)]  # a session joining at 149 blocks
    num_turns = 200
    written = 0
    naive = 0
    for turn in range(num_turns):
        chain = _grow(chain, rng, 1_000_000 * (turn + 1))
        plan = l1.plan_write(sid, chain, float(turn))
        assert plan is not None
        written += plan.num_blocks
        naive += len(chain)
        l1.commit(plan, float(turn))
        entry, matched = l1.match(chain)
        assert entry is not None and matched == len(chain)  # one entry, one contiguous extent
        assert len(entry.hashes) <= entry.capacity_blocks
        l1.check()
    final = len(chain)
    # regrow_fraction 0.5: whole-chain copies add up to at most 1 + 1/0.5 = 3x the final
    # length; every turn rewrites its diverged block and appends its new ones.
    assert written <= 3 * final + 6 * num_turns
    assert written < naive / 10  # the old behaviour copied ~naive
    assert l1.stats().num_entries == 1


def test_a_cut_never_overwrites_slots_an_import_is_reading() -> None:
    l1 = L1Index(1_000, headroom_fraction=0.5, min_headroom_blocks=8)
    sid = SessionId("s")
    first = [BlockHash(i) for i in range(1, 11)]
    plan = l1.plan_write(sid, first, 0.0)
    assert plan is not None
    l1.commit(plan, 0.0)
    entry = l1.entries[sid]
    l1.begin_read(entry)  # a restore of blocks 0..9 is in flight
    diverged = first[:8] + [BlockHash(100), BlockHash(101), BlockHash(102)]
    plan = l1.plan_write(sid, diverged, 1.0)
    assert plan is not None
    assert plan.entry is not entry and plan.first_block == 0  # a new extent, not a cut
    assert l1.match(first)[1] == 10  # the reader's blocks stay readable until the commit
    l1.commit(plan, 1.0)
    l1.end_read(entry)
    assert l1.match(diverged)[1] == 11 and l1.match(first)[1] == 8
    l1.check()
    # With no read in flight the same divergence is a cut + append in place.
    again = diverged[:9] + [BlockHash(200)]
    plan = l1.plan_write(sid, again, 2.0)
    assert plan is not None and plan.entry is l1.entries[sid] and plan.first_block == 9
    assert l1.match(diverged)[1] == 9  # the cut block is unreadable while it is rewritten
    l1.commit(plan, 2.0)
    assert l1.match(again)[1] == 10
    l1.check()


def test_incremental_writes_restore_the_right_bytes_and_count_bytes() -> None:
    """Over real engines ('null' model: a KV row holds its block's token ids): 8 turns that each
    diverge in their last block are written through every turn; bytes written stay near the
    session's size, and after the session is pushed off the GPU the rows restored from its L1
    copy hold exactly the prompt's tokens (cut + append wrote every slot where it belongs)."""

    async def main() -> None:
        rng = np.random.default_rng(7)
        group = await make_group("null", num_blocks=40, num_ranks=1, host_slots=96)
        mgr, registry = make_manager(group, l1_write_watermark=0.0, protect_s=0.0)
        bs = group.block_size
        try:
            prompt = tokens(rng, 60)
            num_turns = 8
            final_blocks = 0
            for _ in range(num_turns):
                turn = await run_turn(mgr, group, prompt, "a", max_tokens=6)
                await mgr.drain()
                final_blocks = mgr.l1.backed_blocks(turn.admission.session_id)
                out = np.asarray(turn.output_ids, dtype=np.int32)
                # The client re-sends the output differently (as real ones do) plus new input.
                prompt = np.concatenate([turn.prompt, out[:-3], tokens(rng, 3), tokens(rng, 14)])
            written_bytes = registry.get_sample_value("deepinfer_cache_l1_written_bytes_total")
            written_blocks = registry.get_sample_value("deepinfer_cache_l1_written_blocks_total")
            assert written_bytes == written_blocks * group.bytes_per_block
            # Whole-session rewrites would be ~ sum over turns of the chain (~ N x blocks / 2).
            assert written_blocks <= 3 * final_blocks + 2 * num_turns
            assert written_blocks < num_turns * final_blocks / 2
            await run_turn(mgr, group, tokens(rng, 560), "b", stop=StopKind.END_TURN)  # push a out
            await mgr.drain()
            hashes = mgr.hasher.hashes(prompt)
            assert mgr.l1.match(hashes)[1] > mgr.l0[0].match(hashes) + 2  # mostly off the GPU
            adm = await mgr.admit(prompt, "a", 4)
            assert adm.cached_tokens_by_tier[Tier.L1] > 0
            rows = group.engines[0].pool.view(torch.int32).view(-1)
            for i, block_id in enumerate(adm.prefix_blocks):
                got = rows[block_id * bs : (block_id + 1) * bs].numpy()
                assert np.array_equal(got, prompt[i * bs : (i + 1) * bs]), f"block {i} holds wrong KV"
            mgr.abort(adm)
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())
