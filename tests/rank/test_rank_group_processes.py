"""RankGroup with real rank processes on CPU (gloo lockstep), reference engine 'tiny'.

Failure tests assert behaviour, not a stopwatch: every in-flight request ends with RankFailed
and none hangs (pytest timeouts guard that); the measured detection time is printed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from rank.client import GroupState
from rank.engine import (
    CapacityExhausted,
    EngineMisuse,
    EngineRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
)
from rank.errors import RankFailed, RankUnavailable
from rank.group import RankGroup
from rank.launch import rank_env
from server.config import WorkloadConfig
from tests.rank.rank_stream_helpers import collect

BLOCK = 16


def _config(**overrides: Any) -> WorkloadConfig:
    base: dict[str, Any] = dict(reference_model="tiny", ep=4, block_size=BLOCK, reference_num_blocks=256,
                                max_num_batched_tokens=256, l1_host_gb=0.005,
                                api_key="sk-secret-should-not-leak")
    base.update(overrides)
    return WorkloadConfig(**base)


def _request(rid: str, length: int, max_tokens: int, seed: int = 0) -> EngineRequest:
    ids = np.random.default_rng(seed).integers(3, 129_280, length).astype(np.int32)
    return EngineRequest(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _drain_kept(group: RankGroup, results: list[tuple[int, RequestOutput]]) -> None:
    for rank, out in results:
        if out.kept_blocks:
            await group.release(rank, out.kept_blocks)


async def _wait_idle(group: RankGroup) -> None:
    for _ in range(1200):  # stats arrive every 100 ms; up to 60 s on a loaded machine
        if all(group.stats(r).num_free_blocks == group.num_blocks - 1 for r in range(group.num_ranks)):
            return
        await asyncio.sleep(0.05)
    raise AssertionError([group.stats(r) for r in range(group.num_ranks)])


@pytest.mark.timeout(240)
def test_four_ranks_lockstep_serve_then_sigkill_restart_and_serve_again() -> None:
    async def scenario() -> None:
        group = RankGroup(_config().rank_config())
        epochs: list[int] = []
        group.add_restart_listener(epochs.append)
        await group.start()
        try:
            assert group.state == GroupState.READY and group.epoch == 1 and len(group.pids()) == 4
            assert group.num_host_slots > 0 and group.bytes_per_block > 0
            # Many concurrent requests of different lengths on all four ranks.
            lengths = [3, 17, 40, 90, 5, 64, 33, 120, 8, 50, 77, 16, 2, 101, 45, 29]
            streams = [(i % 4, group.submit(i % 4, _request(f"a{i}", n, 3 + i % 7, seed=i)))
                       for i, n in enumerate(lengths)]
            results = await asyncio.gather(*(collect(s) for _, s in streams))
            for i, (tokens, last) in enumerate(results):
                assert len(tokens) == 3 + i % 7 and last.finish_reason == FinishReason.LENGTH
                assert last.num_prompt_tokens == lengths[i]
                assert len(last.kept_blocks) == (lengths[i] + len(tokens) - 1) // BLOCK
            # Same prompt on two ranks: same weights everywhere, same greedy tokens.
            same = await asyncio.gather(collect(group.submit(0, _request("s0", 30, 5, 99))),
                                        collect(group.submit(3, _request("s3", 30, 5, 99))))
            assert same[0][0] == same[1][0]
            # Blocks move between ranks through the shared host pool.
            kept = results[3][1].kept_blocks  # rank 3
            await group.export_blocks(3, kept, 10)
            moved = await group.import_blocks(1, 10, len(kept))
            assert len(moved) == len(kept)
            with pytest.raises(EngineMisuse):
                await group.release(1, [0])
            with pytest.raises(CapacityExhausted):
                await group.import_blocks(1, 0, group.num_blocks)
            await group.release(1, moved)
            await _drain_kept(group, [(r, out) for (r, _), (_, out) in zip(streams, results)])
            await _drain_kept(group, [(0, same[0][1]), (3, same[1][1])])
            await _wait_idle(group)
            # A rejected request fails its own stream only.
            bad = group.submit(2, EngineRequest("bad", np.array([5, 6], np.int32), SamplingParams(4),
                                                prefix_blocks=[1], num_cached_tokens=BLOCK))
            with pytest.raises(EngineMisuse):
                await collect(bad)

            # SIGKILL one rank under load.
            load = [group.submit(i % 4, _request(f"k{i}", 20 + 3 * i, 10_000, seed=i)) for i in range(24)]
            first = await asyncio.wait_for(load[1].__anext__(), 60)  # the group is stepping
            assert first.token_ids
            victim = group.pids()[1]
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            outcomes = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in load),
                                                             return_exceptions=True), 60)
            detected_s = time.monotonic() - killed_at
            print(f"\nSIGKILL of rank 1: all {len(load)} in-flight requests failed {detected_s:.2f}s after "
                  "the kill")
            assert all(isinstance(o, RankFailed) for o in outcomes), outcomes
            assert "rank 1" in str(outcomes[0]) and "SIGKILL" in str(outcomes[0])
            assert group.state in (GroupState.RESTARTING, GroupState.READY)
            if group.state != GroupState.READY:  # the restart is usually still loading here
                with pytest.raises(RankUnavailable):
                    group.submit(0, _request("early", 5, 2))
            await group.wait_ready(120)
            assert group.epoch == 2 and epochs == [2] and group.restarts == 1
            assert victim not in group.pids()
            health = group.health()
            assert health["state"] == "ready" and "SIGKILL" in health["last_failure"]
            assert all(r["alive"] for r in health["ranks"])
            again = await asyncio.gather(*(collect(group.submit(r, _request(f"b{r}", 25, 4, r)))
                                           for r in range(4)))
            assert all(len(tokens) == 4 for tokens, _ in again)
            await _drain_kept(group, [(r, out) for r, (_, out) in enumerate(again)])
            await _wait_idle(group)
        finally:
            await group.close()
        assert group.state == GroupState.STOPPED
        assert not os.path.exists(group.host_pool_path)

    asyncio.run(scenario())


@pytest.mark.timeout(180)
def test_sigstop_stall_is_detected_by_heartbeats() -> None:
    async def scenario() -> None:
        group = RankGroup(_config(ep=2, reference_model="null").rank_config())
        await group.start()
        stopped = None
        try:
            load = [group.submit(i % 2, _request(f"k{i}", 40, 100_000, seed=i)) for i in range(8)]
            await asyncio.wait_for(load[0].__anext__(), 60)
            stopped = group.pids()[0]
            stopped_at = time.monotonic()
            os.kill(stopped, signal.SIGSTOP)
            outcomes = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in load),
                                                             return_exceptions=True), 60)
            print(f"\nSIGSTOP of rank 0: detected and failed {time.monotonic() - stopped_at:.2f}s after the "
                  "stop")
            assert all(isinstance(o, RankFailed) for o in outcomes), outcomes
            assert "stalled" in str(outcomes[0]) and "rank 0" in str(outcomes[0])
            await group.wait_ready(120)
            assert group.epoch == 2
            tokens, _ = await collect(group.submit(0, _request("after", 10, 3)))
            assert len(tokens) == 3
        finally:
            if stopped is not None:
                try:
                    os.kill(stopped, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            await group.close()

    asyncio.run(scenario())


def test_rank_env_is_minimal_and_rotates_gpus() -> None:
    cfg = _config(reference_device="cuda", env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
                  deepinfer_env={"DEEPINFER_USE_MULTIMODAL_POOL": "0"})
    base_env = {"PATH": "/usr/bin", "OPENAI_API_KEY": "sk-x", "IK_TOKEN": "t",
                "TRITON_CACHE_DIR": "/cache/triton",
                "NCCL_DEBUG": "WARN"}
    env = rank_env(cfg.rank_config(), 4, 2, 29500, base_env)
    assert env["CUDA_VISIBLE_DEVICES"] == "6,4,5,7"
    assert env["MASTER_PORT"] == "29500" and env["TRITON_CACHE_DIR"] == "/cache/triton"
    assert env["DEEPINFER_USE_MULTIMODAL_POOL"] == "0" and env["NCCL_DEBUG"] == "WARN"
    assert "OPENAI_API_KEY" not in env and "IK_TOKEN" not in env
    assert env["PYTHONPATH"] and env["PATH"] == "/usr/bin"


def test_missing_interpreter_fails_clearly() -> None:
    async def scenario() -> None:
        group = RankGroup(_config().rank_config(), python="/nonexistent/bin/python")
        with pytest.raises(RankFailed, match="does not exist"):
            await group.start()
        assert group.state == GroupState.FAILED
        with pytest.raises(RankUnavailable):
            group.submit(0, _request("x", 4, 1))

    asyncio.run(scenario())
