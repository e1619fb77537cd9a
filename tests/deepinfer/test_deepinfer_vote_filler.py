"""rank/vote_filler.py against DeepInfer's REAL compiled Scheduler voting across two rank processes.

Two ``rank.worker`` processes run the adapter over ``standins.fake_deepinfer_lockstep`` with
``core: installed``: DeepInfer's own Scheduler decides every step's type by its ALL/ANY votes
over the ranks' gloo group (scheduler.hpp ``_schedule``), the filler's collective runs on the
worker's side group. Only the forward is the stand-in's.

The shape under test: rank 1 decodes a long reply and has nothing waiting; rank 0 gets two
prompts that one step's budget (512 tokens) cannot take together, so the second is chunked and
its rest must wait for the next passing vote. ALL points come every 4 decode steps, ANY points
every 200. Without the filler every ALL point fails (rank 1 wants nothing), so rank 0's prompts
wait for an ANY point, after rank 1's 150-token reply is over. With it they run within a few
steps, while that reply is still at its start. Counted in tokens of rank 1's reply, not time.

Run by ``bash scripts/test_deepinfer_build.sh`` (marker ``deepinfer_build``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np
import pytest

from rank.config import RankConfig
from rank.engine import EngineRequest, FinishReason, SamplingParams
from rank.group import RankGroup

pytestmark = pytest.mark.deepinfer_build

NUM_BLOCKS = 96
LONG_REPLY = 150


def _config(vote_filler: bool, max_num_seqs: int = 8) -> RankConfig:
    fake = {"core": "installed", "num_gpu_blocks": NUM_BLOCKS, "vocab_size": 1000}
    return RankConfig(
        engine="deepinfer", deepinfer_venv=sys.prefix, model_dir="/nonexistent/model", ep=2,
        max_model_len=4096, max_num_seqs=max_num_seqs, max_num_batched_tokens=512, prefill_attempt_interval=4,
        prefill_any_attempt_interval=200, vote_filler=vote_filler, l1_host_gb=0.002, load_timeout_seconds=180,
        deepinfer_env={"DIB_DEEPINFER_MODULE": "standins.fake_deepinfer_lockstep",
                       "DIB_FAKE_DEEPINFER": json.dumps(fake), "OMP_NUM_THREADS": "1"},
    )


def _request(rid: str, n: int, max_tokens: int, seed: int) -> EngineRequest:
    ids = np.random.default_rng(seed).integers(3, 1000, size=n, dtype=np.int32)
    return EngineRequest(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), [], 0, False)


async def _reply_tokens_before_second_prompt_starts(group: RankGroup) -> tuple[int, bool]:
    """(tokens of rank 1's reply when rank 0's second prompt emits its first, was that reply over)."""
    long_stream = group.submit(1, _request("long", 100, LONG_REPLY, seed=1))
    long_tokens = 0
    first = await long_stream.__anext__()  # rank 1 is decoding
    long_tokens += len(first.token_ids)
    a = group.submit(0, _request("a", 400, 4, seed=2))
    b = group.submit(0, _request("b", 400, 4, seed=3))  # 400 + 400 > 512: b is chunked
    seen: dict[str, int] = {}
    long_done = False

    async def read_long() -> None:
        nonlocal long_tokens, long_done
        async for out in long_stream:
            long_tokens += len(out.token_ids)
            if out.finished:
                assert out.finish_reason == FinishReason.LENGTH
                long_done = True

    async def read(name: str, stream: object) -> None:
        async for out in stream:  # type: ignore[attr-defined]
            if out.token_ids and name not in seen:
                seen[name] = long_tokens
                if name == "b":
                    seen["b_long_done"] = int(long_done)
            if out.finished:
                assert out.finish_reason == FinishReason.LENGTH

    await asyncio.wait_for(asyncio.gather(read_long(), read("a", a), read("b", b)), 120)
    assert long_tokens == LONG_REPLY
    return seen["b"], bool(seen["b_long_done"])


async def _wait_all_free(group: RankGroup) -> None:
    for _ in range(1200):
        if all(group.stats(r).num_free_blocks == group.num_blocks - 1 for r in range(group.num_ranks)):
            return
        await asyncio.sleep(0.05)
    raise AssertionError([group.stats(r) for r in range(group.num_ranks)])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("vote_filler", [True, False])
def test_filler_lets_a_ranks_leftover_prompt_go_at_the_next_all_point(vote_filler: bool) -> None:
    if not os.environ.get("DEEPINFER_BUILD_DIR"):
        pytest.skip("needs DeepInfer's build: bash scripts/test_deepinfer_build.sh")

    async def scenario() -> None:
        group = RankGroup(_config(vote_filler), python=sys.executable)
        await group.start()
        try:
            tokens_before_b, long_was_over = await _reply_tokens_before_second_prompt_starts(group)
            if vote_filler:
                assert not long_was_over and tokens_before_b < LONG_REPLY // 3, tokens_before_b
            else:  # every ALL point failed: b waited for an ANY point, after the long reply ended
                assert long_was_over and tokens_before_b == LONG_REPLY
            await _wait_all_free(group)  # fillers leave no block behind on either rank
            fillers = [group.stats(r).num_vote_fillers_total for r in range(2)]  # the metric's source
            assert (fillers[1] > 0) if vote_filler else (fillers == [0, 0]), fillers
        finally:
            await group.close()
        assert [r.proc.returncode if r.proc is not None else None for r in group.links] == [0, 0]

    asyncio.run(scenario())


@pytest.mark.timeout(300)
def test_no_filler_while_the_waiting_head_cannot_start() -> None:
    """Rank 0 runs max_num_seqs (2) replies and has a third prompt waiting for a slot: DeepInfer's
    vote there is yes (a waiting head under the watermark), but the head cannot be scheduled. A
    filler on rank 1 would make prompt steps of the filler alone (DeepInfer's second vote passes on
    it), each resetting decode_step to an ALL point: the loop the head-can-start guard prevents.
    So rank 1 queues fillers only for heads that can start: the two first prompts' (when they reach
    rank 0 in different iterations) and the third's once a slot is free: at most 3 (without the
    guard: 64 in one run, 8 per ALL point until the streak cap)."""
    if not os.environ.get("DEEPINFER_BUILD_DIR"):
        pytest.skip("needs DeepInfer's build: bash scripts/test_deepinfer_build.sh")

    async def scenario() -> None:
        group = RankGroup(_config(True, max_num_seqs=2), python=sys.executable)
        await group.start()
        try:
            running = [group.submit(0, _request(f"run-{i}", 100, 80, seed=10 + i)) for i in range(2)]
            for s in running:
                await s.__anext__()  # both decoding: rank 0's slots are full
            third = group.submit(0, _request("third", 100, 4, seed=20))
            outs = []
            for s in [*running, third]:
                async for out in s:
                    outs.append(out)
            assert sum(1 for o in outs if o.finished and o.finish_reason == FinishReason.LENGTH) == 3
            await _wait_all_free(group)
            fillers = [group.stats(r).num_vote_fillers_total for r in range(2)]
            assert fillers[0] == 0 and fillers[1] <= 3, fillers
        finally:
            await group.close()

    asyncio.run(scenario())
