"""Quick checks that the reference engine, the local group and the host pool work together."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from rank.engine import EngineRequest, FinishReason, SamplingParams
from rank.local_group import LocalRankGroup
from server.config import WorkloadConfig


def test_local_group_serves_and_moves_blocks_between_ranks() -> None:
    async def scenario() -> None:
        cfg = WorkloadConfig(reference_model="null", ep=2, block_size=16, reference_num_blocks=64)
        group = LocalRankGroup.from_config(cfg.rank_config(), host_pool_bytes=1 << 20)
        await group.start()
        try:
            stream = group.submit(0,
                                  EngineRequest("x", np.arange(40, dtype=np.int32),
                                                SamplingParams(max_tokens=5)))
            outputs = [o async for o in stream]
            assert sum(len(o.token_ids) for o in outputs) == 5
            last = outputs[-1]
            assert last.finished and last.finish_reason == FinishReason.LENGTH
            assert len(last.kept_blocks) == (40 + 5 - 1) // 16
            await group.export_blocks(0, last.kept_blocks, 3)
            ids = await group.import_blocks(1, 3, len(last.kept_blocks))
            assert torch.equal(group.engines[1].pool[ids], group.engines[0].pool[last.kept_blocks])
            await group.release(0, last.kept_blocks)
            await group.release(1, ids)
            group.check_accounting()
            assert group.stats(0).num_free_blocks == 63
        finally:
            await group.close()

    asyncio.run(scenario())
